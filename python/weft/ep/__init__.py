"""weft.ep: expert-parallel dispatch and combine over NVLink (weft::ep from torch).

Two APIs over the same kernels:
- DeepEP V1's intranode API: `Buffer`, `Config`, `EventOverlap`, `EventHandle`, `topk_idx_t`
  and `utils`; code written for `deep_ep` runs unchanged after `register_as_deep_ep()` (or with
  `python -m weft.ep.as_deep_ep script.py`, or `import weft.ep as deep_ep`; docs/python.md),
  and its low-latency calls (`Buffer(..., low_latency_mode=True)`: `low_latency_dispatch`,
  `low_latency_combine`; low_latency.py).
- The native API: `NativeBuffer` (sized by tokens; zero-copy results, the count on the device,
  the expanded layout, receive statistics, per-call num_sms).
"""

from .._nccl import require as _require_nccl; _require_nccl()  # noqa: E702  binds NCCL (weft/_nccl.py)
import torch

from . import utils
from .deep_ep_alias import register_as_deep_ep
from .buffer import Buffer, Handle
from .communicator import Communicator
from .config import Config
from .event import EventHandle, EventOverlap
from .native import DispatchResult, Expand, NativeBuffer, NativeHandle, pack_fp8, unpack_fp8

# DeepEP's dtype of topk_idx.
topk_idx_t = torch.int64

__all__ = ["Buffer", "Communicator", "Config", "DispatchResult", "EventHandle", "EventOverlap",
           "Expand", "Handle", "NativeBuffer", "NativeHandle", "pack_fp8", "register_as_deep_ep", "topk_idx_t",
           "unpack_fp8", "utils"]
