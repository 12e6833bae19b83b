"""weft.ep.Buffer: DeepEP V1's intranode `deep_ep.Buffer`, on weft's kernels.

Code written for DeepEP runs unchanged once `weft.ep.register_as_deep_ep()` has run (or with
`import weft.ep as deep_ep`); what differs and why is in docs/python.md ("Migrating from
DeepEP"). The Buffer is a thin layer on NativeBuffer's public API:
- The communicator and the comm stream are made in __init__. The window is laid out at the first
  dispatch from its shapes (hidden, top-k, experts) and the largest T per rank whose window fits
  num_nvl_bytes; a dispatch with other shapes lays out a new window, and one that sends more
  tokens than the window holds grows it (Buffer.num_regrowths): every rank learns that from the
  count exchange of the same call, so every rank grows at the same call and no rank waits for
  one that does not.
- Results are tensors the caller owns (copied out of the window on the comm stream, allocated on
  the caller's stream unless allocate_on_comm_stream).
- A handle is DeepEP's tuple and stays usable after later dispatches, but only the latest layout
  is cheap: using an older one re-runs its layout (one extra dispatch) first
  (Buffer.num_relayouts). A handle of a window laid out for other shapes is refused.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import Error, _weft
from . import _group
from .communicator import Communicator
from .config import Config, combine_config, dispatch_config
from .event import EventHandle, EventOverlap
from . import low_latency
from .torch_modes import outside_torch_function_modes
from .layout import dispatch_layout
from .low_latency import LowLatency
from .native import (_BF16, _NO_EVENT, _T_BF16, _T_F32, _T_I32, _T_I64, _UINT8, CommCall,
                     DispatchCounts, NativeBuffer, NativeHandle, _current_raw_stream,
                     async_event, check_stream_options, check_tensor, check_x, event_of, flat,
                     no_event, plain_token_rows, set_copy_out_rows, set_own_rows)
from .sizing import max_tokens_for

# weft's top_k is fixed per window; DeepEP calls may pass any K up to this (or none): selections
# are padded with -1 to the window's.
_MIN_TOP_K = 8
_MAX_ALIGNMENT = 2**31 - 1  # the extension's count_alignment is an int
_MAX_TOP_K = 32
_NULL_CONTEXT = contextlib.nullcontext()  # reusable: it keeps no state
# A grown window holds this many times the tokens that did not fit (so that slowly growing T
# does not regrow at every call).
_GROWTH = 1.25


class _Layout:
    """What a handle needs of its dispatch beyond DeepEP's tuple (mutable: a re-run layout gets
    a new native handle)."""

    __slots__ = ("buffer_serial", "window_shapes", "native", "num_tokens", "num_recv",
                 "num_worst_tokens", "is_token_in_rank", "recv_src")

    def __init__(self, buffer_serial: int, window_shapes: Tuple[int, int, int], native,
                 num_tokens: int, num_recv: Optional[int], num_worst_tokens: int,
                 is_token_in_rank: torch.Tensor, recv_src) -> None:
        self.buffer_serial = buffer_serial
        self.window_shapes = window_shapes  # (hidden, num_experts, top_k) of its window
        self.native = native
        self.num_tokens = num_tokens
        self.num_recv = num_recv  # None: only on the device (num_worst_tokens > 0)
        self.num_worst_tokens = num_worst_tokens
        # [T, R]: the caller's, as DeepEP's handle holds it. The rows a rank receives, and their
        # order (source rank, then token), depend only on it: what re-running the layout needs.
        self.is_token_in_rank = is_token_in_rank
        self.recv_src = recv_src  # owned [rows, 2]; padding rows of a worst-case layout: token T

    @property
    def num_rows(self) -> int:
        """Rows of the received tensors: num_recv, or num_worst_tokens."""
        return self.num_recv if self.num_recv is not None else self.num_worst_tokens


class Handle(tuple):
    """A dispatch's layout, DeepEP's handle tuple: (rank_prefix_matrix [R, R] int32,
    channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx [rows] int32,
    is_token_in_rank [T, R] bool, send_head). weft has no channels and no send head: those are
    None. rank_prefix_matrix[i][j] is the number of rows rank j received from ranks 0..i,
    computed on every rank by its own kernel (no collective)."""

    def __new__(cls, rank_prefix_matrix: torch.Tensor, is_token_in_rank: torch.Tensor,
                layout: _Layout) -> "Handle":
        h = super().__new__(cls, (rank_prefix_matrix, None, None, layout.recv_src[:, 1],
                                  is_token_in_rank, None))
        h.layout = layout
        return h

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens


class Buffer:
    """DeepEP's intranode Buffer over a torch.distributed NCCL group (or None: one GPU).

    DeepEP's parameters come in DeepEP's order; what weft cannot honour raises weft.Error naming
    the parameter. weft's own, keyword-only: max_tokens (size the first window for this many
    tokens per rank instead of from num_nvl_bytes), timeout_s (bound of every device-side wait),
    recv_x_headroom (a host-synced dispatch makes recv_x before its count is known, for the
    count of the latest such call of as many tokens plus this fraction of it, so that the rows
    are copied as soon as the count is out; a larger count takes the slower path, recv_x made
    at the count. recv_x is a view of the first rows of its allocation, which holds the
    headroom beyond the count, and more where the count fell since the latest call. None:
    recv_x always made at the count, the GPU waiting for the host between the two kernels).
    """

    num_sms: int = 20
    _next_serial = 0

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 max_tokens: Optional[int] = None, timeout_s: float = 20.0,
                 recv_x_headroom: Optional[float] = 0.125) -> None:
        if comm is not None:
            raise Error("Buffer(comm=...): weft.ep takes a torch.distributed group (or None for "
                        "one GPU), not an mpi4py communicator")
        if low_latency_mode and not allow_nvlink_for_low_latency_mode:
            raise Error("Buffer(allow_nvlink_for_low_latency_mode=False): weft.ep's "
                        "low-latency mode runs over NVLink only (no RDMA)")
        if num_rdma_bytes and not low_latency_mode:
            raise Error(f"Buffer(num_rdma_bytes={num_rdma_bytes}): weft.ep is intranode only "
                        f"(no RDMA buffer); pass 0, or low_latency_mode=True, where it bounds "
                        f"the low-latency windows")
        if int(num_rdma_bytes) < 0:
            raise Error(f"Buffer(num_rdma_bytes={num_rdma_bytes}): must be >= 0")
        if allow_mnnvl:
            raise Error("Buffer(allow_mnnvl=True): weft.ep runs the ranks of one node over "
                        "NVLink; multi-node NVLink is not supported")
        if use_fabric:
            raise Error("Buffer(use_fabric=True): weft.ep allocates its window with NCCL "
                        "(ncclMemAlloc); fabric handles are not supported")
        if enable_shrink:
            raise Error("Buffer(enable_shrink=True): weft.ep has no rank masking (shrink mode)")
        if max_tokens is None and int(num_nvl_bytes) <= 0 and not low_latency_mode:
            raise Error("Buffer needs num_nvl_bytes > 0 (or max_tokens=...) to size its window")
        if max_tokens is not None and int(max_tokens) < 1:
            raise Error(f"Buffer(max_tokens={max_tokens}): must be >= 1")
        if recv_x_headroom is not None and (isinstance(recv_x_headroom, bool) or not (
                isinstance(recv_x_headroom, (int, float)) and 0 <= recv_x_headroom <= 8)):
            raise Error(f"Buffer(recv_x_headroom={recv_x_headroom!r}): must be None or a "
                        f"number in [0, 8]")
        self.rank, self.group_size = _group.group_rank_size(group)
        if low_latency_mode:
            low_latency.refuse_internode(group)
        self.group = group
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = False
        self._max_tokens = None if max_tokens is None else int(max_tokens)
        self._timeout_s = float(timeout_s)
        self._recv_x_headroom = None if recv_x_headroom is None else float(recv_x_headroom)
        # The count of the latest host-synced owned dispatch of each T (_owned_x_rows).
        self._latest_num_recv: Dict[int, int] = {}
        self._communicator = Communicator(group, ("weft.ep.Buffer", self.num_nvl_bytes,
                                                  self._max_tokens))
        self._device = self._communicator.device
        self._comm_stream = torch.cuda.Stream(self._device, priority=-1000)
        self._native: Optional[NativeBuffer] = None
        self._destroyed = False
        self._serial = Buffer._next_serial
        Buffer._next_serial += 1
        self.num_relayouts = 0
        self.num_regrowths = 0
        self.num_recv_x_at_count = 0  # host-synced owned dispatches whose recv_x waited for it
        self._low_latency = LowLatency(self) if self.low_latency_mode else None

    # -- DeepEP's static helpers ------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the extension carries kernels for SM 90 (Hopper)."""
        info = _weft.info()
        archs = str(info.get("cuda_architectures", ""))
        return bool(info.get("built_with_cuda")) and any(a.startswith("90")
                                                         for a in archs.replace(",", ";").split(";"))

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SM count of the default configs (DeepEP's rule: even)."""
        if not isinstance(new_num_sms, int) or new_num_sms % 2 != 0 or new_num_sms < 0:
            raise Error(f"set_num_sms: the SM count must be an even int >= 0, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (for previous_event)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return dispatch_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return combine_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes for num_rdma_bytes: weft's two low-latency windows of one rank (any top-k)."""
        return low_latency.rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                          num_experts)

    def get_comm_stream(self) -> torch.cuda.Stream:
        self._check_alive("get_comm_stream")
        return self._comm_stream

    def get_local_device_id(self) -> int:
        return self._device.index

    def get_local_buffer_tensor(self, *args, **kwargs):
        raise Error("get_local_buffer_tensor: weft's window is laid out by its kernels and has no "
                    "free scratch region; allocate a torch tensor instead")

    @property
    def runtime(self):
        raise Error("Buffer.runtime: weft.ep has no DeepEP C++ runtime object; use the Buffer's "
                    "methods (the native API is weft.ep.NativeBuffer)")

    def internode_dispatch(self, *args, **kwargs):
        raise Error("internode_dispatch: weft.ep is intranode only (NVLink within one node)")

    def internode_combine(self, *args, **kwargs):
        raise Error("internode_combine: weft.ep is intranode only (NVLink within one node)")

    def low_latency_update_mask_buffer(self, *args, **kwargs):
        raise Error("low_latency_update_mask_buffer: weft.ep has no rank masking (shrink mode)")

    def low_latency_query_mask_buffer(self, *args, **kwargs):
        raise Error("low_latency_query_mask_buffer: weft.ep has no rank masking (shrink mode)")

    def low_latency_clean_mask_buffer(self, *args, **kwargs):
        raise Error("low_latency_clean_mask_buffer: weft.ep has no rank masking (shrink mode)")

    # -- low-latency mode (low_latency.py) ------------------------------------------------------
    def _ll(self, what: str) -> LowLatency:
        self._check_alive(what)
        if getattr(self, "_low_latency", None) is None:
            raise Error(f"{what} needs a Buffer made with low_latency_mode=True")
        return self._low_latency

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean in weft: its flags carry call numbers, so no call leaves state a
        later one must see zeroed. Checks the arguments and returns (no collective)."""
        self._ll("clean_low_latency_buffer")
        low_latency.check_shapes(num_max_dispatch_tokens_per_rank, hidden, self.group_size,
                                 num_experts)

    @outside_torch_function_modes
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """DeepEP's low-latency dispatch: (recv_x, recv_count, handle, event, hook); recv_x
        [E_local, M * R, hidden] bf16, or with use_fp8 (e4m3 [E_local, M * R, hidden], scales
        fp32 [E_local, M * R, hidden / 128] column-major; use_ue8m0: int32
        [E_local, M * R, hidden / 512] of UE8M0 exponent bytes); recv_count [E_local] int32.
        See weft.ep.low_latency for the layout, the two-latest-calls rule and the hook."""
        return self._ll("low_latency_dispatch").dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
            round_scale, use_ue8m0, async_finish, return_recv_hook)

    @outside_torch_function_modes
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """DeepEP's low-latency combine: (combined_x [T, hidden] bf16, event, hook), where
        combined_x[t] = sum over k with topk_idx[t, k] >= 0 of topk_weights[t, k] times the
        expert's output row of (t, k) in x [E_local, M * R, hidden] bf16."""
        return self._ll("low_latency_combine").combine(
            x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
            return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """[E_local, M * R, hidden] bf16 that low_latency_combine(..., zero_copy=True) of this
        handle reads the expert outputs from (one per window, allocated at the first call)."""
        return self._ll("get_next_low_latency_combine_buffer").next_combine_buffer(handle)

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise Error("destroy() needs Buffer(..., explicitly_destroy=True) (as in DeepEP)")
        self._release()

    def _release(self) -> None:
        if getattr(self, "_low_latency", None) is not None:
            self._low_latency.destroy()
        if self._native is not None:
            self._native.destroy()
        self._native = None
        if self._communicator.alive:
            self._communicator.destroy()
        self._destroyed = True

    # -- the window ---------------------------------------------------------------------------
    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise Error(f"{what}: this Buffer was destroyed")

    def _window_for(self, hidden: int, top_k: int, num_experts: int) -> NativeBuffer:
        """The window for a dispatch of these shapes (checked): the current one when it fits,
        else a new one (collective: every rank makes the same calls)."""
        n = self._native
        if n is not None and n.hidden == hidden and n.num_experts == num_experts and \
                n.top_k >= top_k:
            return n
        want_k = min(max(top_k, self.group_size, _MIN_TOP_K), _MAX_TOP_K)
        max_tokens = self._max_tokens or max_tokens_for(self.num_nvl_bytes, hidden,
                                                        self.group_size, want_k, num_experts)
        if max_tokens < 1:
            raise Error(f"num_nvl_bytes={self.num_nvl_bytes} holds no token of hidden {hidden} at "
                        f"{self.group_size} ranks")
        return self._lay_out(max_tokens, hidden, num_experts, want_k)

    def _lay_out(self, max_tokens: int, hidden: int, num_experts: int, top_k: int) -> NativeBuffer:
        if self._native is not None:
            self._native.destroy()
            self._native = None
        self._native = NativeBuffer(self.group, max_tokens=max_tokens, hidden=hidden,
                                    num_experts=num_experts, top_k=top_k,
                                    timeout_s=self._timeout_s, communicator=self._communicator,
                                    comm_stream=self._comm_stream)
        return self._native

    def _grow(self, tokens_required: int) -> NativeBuffer:
        """A window for tokens_required tokens per rank (and some room), with the same shapes:
        every rank calls this at the same call, having learnt tokens_required from the same
        count exchange."""
        n = self._native
        self.num_regrowths += 1
        return self._lay_out(max(int(tokens_required * _GROWTH), tokens_required), n.hidden,
                             n.num_experts, n.top_k)

    # -- layout ---------------------------------------------------------------------------------
    @outside_torch_function_modes
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event), as DeepEP's. No host sync and no collective: the
        counts are computed on the device (on the comm stream with previous_event or
        async_finish, into tensors allocated on the caller's stream unless
        allocate_on_comm_stream)."""
        self._check_alive("get_dispatch_layout")
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), self._device, (None, None))
        if not isinstance(num_experts, int) or num_experts <= 0 or \
                num_experts % self.group_size != 0:
            raise Error(f"num_experts {num_experts!r} must be a positive multiple of the group "
                        f"size {self.group_size}")
        check_stream_options(previous_event, async_finish, allocate_on_comm_stream)
        num_tokens = topk_idx.shape[0]

        def outputs():
            return (torch.empty(self.group_size, dtype=torch.int32, device=self._device),
                    torch.empty(num_experts, dtype=torch.int32, device=self._device),
                    torch.empty((num_tokens, self.group_size), dtype=torch.bool,
                                device=self._device))

        if event_of(previous_event) == 0 and not async_finish:
            per_rank, per_expert, in_rank = outputs()
            dispatch_layout(topk_idx, num_experts, self.group_size, (per_rank, per_expert, in_rank))
            return per_rank, None, per_expert, in_rank, EventOverlap(None)
        with self._comm_call(previous_event, async_finish, allocate_on_comm_stream) as call:
            with call.allocating():
                outs = outputs()
            dispatch_layout(topk_idx, num_experts, self.group_size, outs)
            call.keep(topk_idx, *outs)
        per_rank, per_expert, in_rank = outs
        return per_rank, None, per_expert, in_rank, call.event

    def _comm_call(self, previous_event, async_finish: bool, allocate_on_comm_stream: bool):
        """A CommCall on this Buffer's comm stream (the window need not exist yet)."""
        return CommCall(self._stream_owner(), previous_event, async_finish,
                        allocate_on_comm_stream)

    def _stream_owner(self):
        if self._native is not None:
            return self._native
        return _StreamOnly(self._comm_stream, self._device)

    # -- dispatch -------------------------------------------------------------------------------
    @outside_torch_function_modes
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Handle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """DeepEP's intranode dispatch: (recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event); a cached call (handle=) returns
        (recv_x, None, None, None, None, event)."""
        self._check_alive("dispatch")
        num_sms = self._num_sms(config, self.get_dispatch_config)
        if num_tokens_per_rdma_rank is not None:
            raise Error("num_tokens_per_rdma_rank: weft.ep is intranode only")
        if not isinstance(expert_alignment, int) or not 1 <= expert_alignment <= _MAX_ALIGNMENT:
            raise Error(f"expert_alignment must be an int in [1, {_MAX_ALIGNMENT}], got "
                        f"{expert_alignment!r}")
        if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise Error(f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
        check_stream_options(previous_event, async_finish, allocate_on_comm_stream)
        is_fp8 = isinstance(x, (tuple, list))
        x_main = x[0] if is_fp8 else x
        if not isinstance(x_main, torch.Tensor) or x_main.dim() != 2:
            raise Error("x must be a [num_tokens, hidden] tensor or the fp8 tuple (x_e4m3, scales)")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise Error("a cached dispatch (handle=...) takes no topk_idx / topk_weights")
            if no_event(previous_event) and not (async_finish or allocate_on_comm_stream):
                result = self._plain_cached_dispatch(x, handle, num_sms)
                if result is not None:
                    return result
            return self._cached_dispatch(x, handle, num_sms, previous_event, async_finish,
                                         allocate_on_comm_stream)
        if num_tokens_per_rank is None or is_token_in_rank is None or \
                num_tokens_per_expert is None:
            raise Error("dispatch needs num_tokens_per_rank, is_token_in_rank and "
                        "num_tokens_per_expert (from get_dispatch_layout), or a handle")
        if (topk_idx is None) != (topk_weights is None):
            raise Error("topk_idx and topk_weights go together")
        # Every input is checked before the window may be laid out anew (a collective).
        shapes = self._plain_inputs(x, num_tokens_per_rank, is_token_in_rank,
                                    num_tokens_per_expert, topk_idx, topk_weights)
        if shapes is None:
            shapes = self._check_inputs(x, x_main, num_tokens_per_rank, is_token_in_rank,
                                        num_tokens_per_expert, topk_idx, topk_weights)
        num_tokens, hidden, top_k, num_experts = shapes
        native = self._window_for(hidden, top_k, num_experts)
        sync = num_worst_tokens == 0
        if topk_idx is not None and top_k == native.top_k:
            res, recv, event = self._dispatch_owned(native, x, is_fp8, topk_idx, topk_weights,
                                                    num_sms, num_tokens, num_worst_tokens,
                                                    expert_alignment, previous_event,
                                                    async_finish, allocate_on_comm_stream)
        else:
            res, recv, event = self._dispatch_widened(native, x, is_fp8, topk_idx, topk_weights,
                                                      is_token_in_rank, num_sms, num_tokens,
                                                      num_worst_tokens, expert_alignment,
                                                      previous_event, async_finish,
                                                      allocate_on_comm_stream)
        native = self._native
        recv_x, recv_src, prefix, recv_idx, recv_w = recv
        if not sync:
            counts: List[int] = []
        elif topk_idx is not None:
            counts = res.tokens_per_local_expert_list  # aligned by the extension
        else:
            counts = self._counts_without_topk(num_tokens_per_expert, expert_alignment)
        layout = _Layout(self._serial, (native.hidden, native.num_experts, native.top_k),
                         res.handle, num_tokens, res.num_recv if sync else None,
                         num_worst_tokens, is_token_in_rank, recv_src)
        return recv_x, recv_idx, recv_w, counts, Handle(prefix, is_token_in_rank, layout), event

    def _check_inputs(self, x, x_main, num_tokens_per_rank, is_token_in_rank,
                      num_tokens_per_expert, topk_idx, topk_weights) -> Tuple[int, int, int, int]:
        """(num_tokens, hidden, top_k (0: none), num_experts) of an uncached dispatch's inputs;
        raises weft.Error for the first that is wrong."""
        num_tokens, hidden = x_main.shape
        device = self._device
        if not isinstance(num_tokens_per_expert, torch.Tensor):
            raise Error("num_tokens_per_expert must be a torch.Tensor")
        num_experts = num_tokens_per_expert.numel()
        check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32,), device,
                     (num_experts,))
        if num_experts == 0 or num_experts % self.group_size != 0:
            raise Error(f"num_tokens_per_expert has {num_experts} experts, not a positive "
                        f"multiple of the group size {self.group_size}")
        check_tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32,), device,
                     (self.group_size,))
        check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,), device,
                     (num_tokens, self.group_size))
        top_k = 0
        if topk_idx is not None:
            check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), device,
                         (num_tokens, None))
            top_k = topk_idx.shape[1]
            check_tensor("topk_weights", topk_weights, (torch.float32,), device,
                         (num_tokens, top_k))
            if not 1 <= top_k <= _MAX_TOP_K:
                raise Error(f"top-k {top_k} is outside weft's range [1, {_MAX_TOP_K}]")
        if hidden * 2 % 16 != 0:
            raise Error(f"hidden {hidden} must be a multiple of 8 (rows move in 16-byte "
                        f"vectors)")
        check_x(x, hidden, device)
        return num_tokens, hidden, top_k, num_experts

    def _plain_inputs(self, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                      topk_idx, topk_weights) -> Optional[Tuple[int, int, int, int]]:
        """_check_inputs' result where every input is of the common case (x bf16 or the fp8
        pair, the selections given, every tensor contiguous on the device), checked with the
        least host work; None otherwise (_check_inputs then runs)."""
        r = self.group_size
        d = self._device.index
        x_shape = plain_token_rows(x, d)
        if x_shape is None:
            return None
        num_tokens, hidden = x_shape
        try:
            ks = topk_idx.shape
            idx_dtype = topk_idx.dtype
            es = num_tokens_per_expert.shape
            if not (hidden % 8 == 0 and
                    (idx_dtype is _T_I64 or idx_dtype is _T_I32) and len(ks) == 2 and
                    ks[0] == num_tokens and 1 <= ks[1] <= _MAX_TOP_K and
                    topk_weights.dtype is _T_F32 and topk_weights.shape == ks and
                    num_tokens_per_expert.dtype is _T_I32 and len(es) == 1 and es[0] > 0 and
                    es[0] % r == 0 and num_tokens_per_rank.dtype is _T_I32 and
                    num_tokens_per_rank.shape == (r,) and is_token_in_rank.dtype is torch.bool
                    and is_token_in_rank.shape == (num_tokens, r) and
                    topk_idx.get_device() == d and topk_weights.get_device() == d and
                    num_tokens_per_expert.get_device() == d and
                    num_tokens_per_rank.get_device() == d and
                    is_token_in_rank.get_device() == d and topk_idx.is_contiguous() and
                    topk_weights.is_contiguous() and num_tokens_per_expert.is_contiguous() and
                    num_tokens_per_rank.is_contiguous() and is_token_in_rank.is_contiguous()):
                return None
        except AttributeError:  # not tensors
            return None
        return num_tokens, hidden, ks[1], es[0]

    def _launch_grown(self, native: NativeBuffer, x, is_fp8: bool, idx, w, num_sms: int,
                      sync: bool, alignment: int, stream: Optional[int] = None,
                      comm_stream: int = 0, previous_event: int = 0, async_finish: bool = False,
                      hold: bool = False, copy=None, res=None):
        """The dispatch, and again on a grown window while some rank sent more tokens than the
        window holds (every rank saw the same count exchange: every rank grows here). With
        hold, the rows this rank sends to itself are deferred to copy_out (own_x=x), which
        writes them from x into the owned tensors: one pass over them, not two; copy: that
        copy_out's arguments, run in the same call where they fit (launch_dispatch). res: the
        counts of a first dispatch already made on native (then only the growth is left)."""
        if res is None:
            res = native.launch_dispatch(x, is_fp8, idx, w, None, None, num_sms, None, sync,
                                         stream, comm_stream, previous_event, async_finish, hold,
                                         alignment, hold, copy)
        while sync and res.tokens_required:
            native = self._grow(res.tokens_required)
            res = native.launch_dispatch(x, is_fp8, idx, w, None, None, num_sms, None, sync,
                                         stream, comm_stream, previous_event, async_finish, hold,
                                         alignment, hold, copy)
        return native, res

    def _owned_results(self, native: NativeBuffer, is_fp8: bool, rows: int, top_k: int,
                       idx_dtype) -> tuple:
        """Empty owned tensors for a dispatch's results, rows rows, on the current stream:
        (recv_x, recv_src, rank_prefix_matrix, recv_topk_idx, recv_topk_weights)."""
        prefix, recv_src, recv_idx, recv_w, scales = self._owned_meta(native, is_fp8, rows,
                                                                      top_k, idx_dtype)
        payload = self._owned_payload(native, is_fp8, rows)
        recv_x = payload if scales is None else (payload, scales)
        return recv_x, recv_src, prefix, recv_idx, recv_w

    def _owned_prefix(self, device) -> torch.Tensor:
        return torch.empty(self.group_size, self.group_size, dtype=torch.int32, device=device)

    def _dispatch_owned(self, native, x, is_fp8, topk_idx, topk_weights, num_sms, num_tokens,
                        num_worst_tokens, alignment, previous_event, async_finish,
                        allocate_on_comm_stream):
        """The common call (the caller's selections fit the window): the kernel on the comm
        stream, the counts read as soon as its count exchange ends (host sync only without
        num_worst_tokens), then the copy kernel that fills the owned tensors, then the hand-off
        back (all stream work inside the extension). So that the GPU does not wait for the host
        between the two kernels, the owned tensors are made before the count is known and the
        copy is launched as soon as it is out, by the extension call that waits for it: every
        owned tensor but recv_x for `bound` rows (this rank's tokens from every rank: a peer
        with more tokens than this rank, rarely, makes them again at the count), recv_x for
        _owned_x_rows (num_worst_tokens: for its rows); all narrowed to the count. A host-synced
        call is launched first and makes them while its kernel runs (the host's wait for the
        count overlaps them; finish_dispatch then waits and copies); a num_worst_tokens call
        makes them before the launch and copies in the same call. Where the count exceeds them
        (or recv_x has no rows yet), the copy waits for tensors made at the count: one more
        extension call. The argument objects are the window's reused ones (_deferring_args), every
        field that varies set here."""
        sync = num_worst_tokens == 0
        comm = native.comm_stream
        stream = _current_raw_stream(native._device_index)
        top_k = topk_idx.shape[1]
        idx_dtype = topk_idx.dtype
        bound = self._owned_rows_bound(num_tokens, num_worst_tokens)
        # recv_x too where its rows can be told: num_worst_tokens, or (host-synced) the latest
        # count plus the headroom (_owned_x_rows).
        x_rows = self._owned_x_rows(num_tokens, bound) if sync else bound
        a, c = native.reused_args(("DeepEP dispatch", is_fp8, sync), self._deferring_args,
                                  native, is_fp8, sync)
        set_own_rows(a.x, c.own_x, x, is_fp8, num_tokens)
        a.topk_idx = topk_idx.data_ptr()
        a.topk_idx_int64 = c.topk_idx_int64 = idx_dtype is _T_I64
        a.topk_weights = topk_weights.data_ptr()
        a.num_sms = num_sms
        a.count_alignment = alignment
        a.stream = c.stream = stream
        a.previous_event = event_of(previous_event)
        a.async_finish = c.async_finish = async_finish
        c.pad_token = num_tokens
        c.num_topk = top_k
        raw = native._native

        def on_comm():  # where the owned tensors are allocated
            return torch.cuda.stream(comm) if allocate_on_comm_stream else _NULL_CONTEXT

        res = None
        try:
            if sync:  # launched first: the tensors are made while its kernel runs
                native.note_layout(raw.dispatch(a, None, None).handle)
            with on_comm():
                meta = self._owned_meta(native, is_fp8, bound, top_k, idx_dtype)
                payload = self._owned_payload(native, is_fp8, x_rows) if x_rows else None
            self._set_copy_targets(c, meta)
            copy = None
            if payload is not None:
                c.num_rows = x_rows
                c.x = payload.data_ptr()
                copy = c
            if sync:
                res = native.finish_dispatch(copy)
            else:
                out = raw.dispatch(a, None, copy)
                res = DispatchCounts(NativeHandle(*out.handle), out)
                native.note_layout(res.handle)
            if sync and res.tokens_required:  # a rank sent more than the window holds
                native, res = self._launch_grown(native, x, is_fp8, topk_idx, topk_weights,
                                                 num_sms, sync, alignment, stream,
                                                 comm.cuda_stream, a.previous_event,
                                                 async_finish, True, copy, res)
        except BaseException:  # a failed launch, allocation, count wait or regrowth
            self._hand_back(stream)
            raise
        rows = res.num_recv if sync else num_worst_tokens
        if sync:
            if len(self._latest_num_recv) >= 64 and num_tokens not in self._latest_num_recv:
                self._latest_num_recv.clear()  # T of every call different: keep it bounded
            self._latest_num_recv[num_tokens] = rows
        if not res.copied:  # recv_x not made yet, or the count exceeds it: made at the count
            self.num_recv_x_at_count += 1
            try:
                with on_comm():
                    if rows > bound:
                        meta = self._owned_meta(native, is_fp8, rows, top_k, idx_dtype)
                        self._set_copy_targets(c, meta)
                        bound = rows
                    payload = self._owned_payload(native, is_fp8, rows)
                c.num_rows = rows
                c.x = payload.data_ptr()
                native.run_copy_out(c)
            except BaseException:
                self._hand_back(stream)
                raise
        prefix, recv_src, recv_idx, recv_w, scales = meta
        if rows < bound:
            recv_src, recv_idx, recv_w = recv_src[:rows], recv_idx[:rows], recv_w[:rows]
            if scales is not None:
                scales = scales[:rows]
        if payload.shape[0] > rows:
            payload = payload[:rows]
        recv_x = payload if scales is None else (payload, scales)
        event = _NO_EVENT
        if async_finish:
            event = async_event(comm, [*flat(x), topk_idx, topk_weights, *flat(recv_x),
                                       recv_src, prefix, recv_idx, recv_w])
        return res, (recv_x, recv_src, prefix, recv_idx, recv_w), event

    @staticmethod
    def _deferring_args(native: NativeBuffer, is_fp8: bool, sync: bool):
        """The reused (DispatchArgs, CopyOutArgs) of one kind of owned dispatch (uncached or
        cached, fp8 or not, host-synced or not), their constant fields set: a held launch that
        defers this rank's own rows and its copy, on the window's comm stream; a host-synced
        one waits for its counts in finish_dispatch. Every tensor they point at is checked to be
        on the device (the inputs by dispatch's checks, the rest made here): pointers_checked."""
        a = _weft.ep.DispatchArgs()
        a.hold = a.defer_own_rows = a.pointers_checked = True
        a.read_counts = a.wait_later = sync
        c = _weft.ep.CopyOutArgs()
        c.deferred_own_rows = c.pointers_checked = True
        a.comm_stream = c.comm_stream = native.comm_stream.cuda_stream
        for rows in (a.x, c.own_x):
            rows.dtype = _UINT8 if is_fp8 else _BF16
            rows.cols = native.hidden
        return a, c

    def _hand_back(self, stream: int) -> None:
        """After a failure past a launch made with hold: the caller's stream (a cudaStream_t)
        waits for the work queued on the comm stream, whose kernels still read the caller's
        inputs, so that the caller's stream does not run ahead of them. A window destroyed
        meanwhile (a regrowth) synchronized its device first: nothing is left to wait for."""
        if self._native is not None and self._native.alive:
            self._native.hand_back(stream)

    @staticmethod
    def _owned_payload(native: NativeBuffer, is_fp8: bool, rows: int) -> torch.Tensor:
        """recv_x of an owned dispatch (fp8: the e4m3 half of the pair), rows rows."""
        return torch.empty(rows, native.hidden, device=native.device,
                           dtype=torch.float8_e4m3fn if is_fp8 else torch.bfloat16)

    def _owned_rows_bound(self, num_tokens: int, num_worst_tokens: int) -> int:
        """The rows an owned dispatch's tensors are made for before its count is known:
        num_worst_tokens, else num_tokens from every rank (enough where every rank has this
        rank's number of tokens or fewer). The narrowed results keep the whole allocation: at
        most 104 bytes a row of the bound at top-8 (with fp8 scales, 4 more per 128 of hidden)."""
        return num_worst_tokens or self.group_size * num_tokens

    def _owned_x_rows(self, num_tokens: int, bound: int) -> int:
        """The rows a host-synced owned dispatch of num_tokens tokens makes recv_x for before its
        count is known (so that its copy is launched as soon as the count is out, the GPU not
        waiting for the host): the count of the latest such call of as many tokens plus
        recv_x_headroom of it, at most bound; 0 (recv_x made at the count) before the first
        such call, after one that received nothing, or with recv_x_headroom=None. A count above
        it takes the slower path (recv_x made at the count); recv_x is a view of the first rows
        of its allocation."""
        latest = self._latest_num_recv.get(num_tokens, 0)
        if self._recv_x_headroom is None or latest <= 0:
            return 0
        return min(bound, latest + int(latest * self._recv_x_headroom))

    def _owned_meta(self, native: NativeBuffer, is_fp8: bool, rows: int, top_k: int, idx_dtype):
        """(rank_prefix_matrix, recv_src, recv_topk_idx, recv_topk_weights, fp8 scales) of an
        owned dispatch, rows rows, on the current stream (the selections None without top_k, the
        scales None without fp8). Sizes go positionally: torch parses them faster than a shape
        tuple."""
        device = native.device
        recv_idx = recv_w = None
        if top_k:
            recv_idx = torch.empty(rows, top_k, dtype=idx_dtype, device=device)
            recv_w = torch.empty(rows, top_k, dtype=torch.float32, device=device)
        return (self._owned_prefix(device), torch.empty(rows, 2, dtype=torch.int32, device=device),
                recv_idx, recv_w, self._owned_scales(native, rows) if is_fp8 else None)

    @staticmethod
    def _owned_scales(native: NativeBuffer, rows: int) -> torch.Tensor:
        """The fp8 pair's scales of an owned dispatch: fp32 [rows, hidden / 128], row-major."""
        return torch.empty(rows, native.hidden // 128, dtype=torch.float32, device=native.device)

    @staticmethod
    def _set_copy_targets(c, meta) -> None:
        """The copy kernel's arguments c (CopyOutArgs, in place) point at meta's tensors
        (_owned_meta), all but recv_x."""
        prefix, recv_src, recv_idx, recv_w, scales = meta
        c.src = recv_src.data_ptr()
        c.topk_idx = recv_idx.data_ptr()
        c.topk_weights = recv_w.data_ptr()
        c.rank_prefix_matrix = prefix.data_ptr()
        if scales is not None:
            c.x_scales = scales.data_ptr()

    def _dispatch_widened(self, native, x, is_fp8, topk_idx, topk_weights, is_token_in_rank,
                          num_sms, num_tokens, num_worst_tokens, alignment, previous_event,
                          async_finish, allocate_on_comm_stream):
        """A call whose selections are widened to the window's top-k first (fewer columns than
        the window's, or routing by is_token_in_rank alone): torch ops and the kernel on the
        comm stream (CommCall)."""
        sync = num_worst_tokens == 0
        top_k = 0 if topk_idx is None else topk_idx.shape[1]
        idx_dtype = None if topk_idx is None else topk_idx.dtype
        with self._comm_call(previous_event, async_finish, allocate_on_comm_stream) as call:
            idx_in, w_in = self._selections(native, topk_idx, topk_weights, is_token_in_rank)
            native, res = self._launch_grown(native, x, is_fp8, idx_in, w_in, num_sms, sync,
                                             alignment)
            call.buffer = native
            rows = res.num_recv if sync else num_worst_tokens
            with call.allocating():
                recv = self._owned_results(native, is_fp8, rows, top_k, idx_dtype)
            recv_x, recv_src, prefix, recv_idx, recv_w = recv
            native.copy_out(rows, recv_x, src=recv_src, pad_token=num_tokens, topk_idx=recv_idx,
                            topk_weights=recv_w, rank_prefix_matrix=prefix,
                            stream=_current_raw_stream(native.device.index))
            call.keep(*flat(x), idx_in, w_in, topk_idx, topk_weights, *flat(recv_x), recv_src,
                      prefix, recv_idx, recv_w)
        return res, recv, call.event

    def _num_sms(self, config: Optional[Config], default) -> int:
        """The most SMs (blocks) of the call: config.num_sms, even as in DeepEP; 0 = every SM."""
        if config is None:
            config = default(self.group_size)
        elif not isinstance(config, Config):
            raise Error(f"config must be a weft.ep.Config, got {type(config).__name__}")
        if config.num_sms % 2 != 0:
            raise Error(f"config.num_sms must be even (as in DeepEP), got {config.num_sms}")
        return config.num_sms

    def _selections(self, native: NativeBuffer, topk_idx, topk_weights, is_token_in_rank):
        """The selections the kernel reads: the caller's when they fit the window's top_k, else
        copies widened with -1 / 0 (made on the current stream, the comm stream). Without top-k
        (routing by is_token_in_rank alone) each destination rank gets one selection of its
        first expert."""
        k = native.top_k
        if topk_idx is not None and topk_idx.shape[1] == k:
            return topk_idx, topk_weights
        num_tokens = is_token_in_rank.shape[0]
        idx = torch.full((num_tokens, k), -1, dtype=torch.int64, device=native.device)
        w = torch.zeros((num_tokens, k), dtype=torch.float32, device=native.device)
        if topk_idx is not None:
            idx[:, :topk_idx.shape[1]].copy_(topk_idx)
            w[:, :topk_weights.shape[1]].copy_(topk_weights)
        else:
            first = torch.arange(self.group_size, device=native.device) * native.num_local_experts
            idx[:, :self.group_size].copy_(torch.where(is_token_in_rank, first, -1))
        return idx, w

    def _counts_without_topk(self, num_tokens_per_expert: torch.Tensor, alignment: int) -> list:
        total = num_tokens_per_expert.clone()
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        mine = total.view(self.group_size, -1)[self.rank].tolist()
        return [-(-c // alignment) * alignment for c in mine]

    def _native_of(self, handle, what: str) -> NativeBuffer:
        """The window a call with handle runs on; raises unless handle is this Buffer's and its
        window's shapes are the current window's."""
        if not isinstance(handle, Handle):
            raise Error(f"{what}: handle must come from this Buffer's dispatch, got "
                        f"{type(handle).__name__}")
        self._check_alive(what)
        layout = handle.layout
        if layout.buffer_serial != self._serial:
            raise Error(f"{what}: the handle comes from another Buffer")
        native = self._native
        shapes = (native.hidden, native.num_experts, native.top_k)
        if layout.window_shapes != shapes:
            h, e, k = layout.window_shapes
            raise Error(f"{what}: the handle's dispatch ran on a window for hidden {h}, {e} "
                        f"experts, top-k {k}; this Buffer has since been laid out for hidden "
                        f"{shapes[0]}, {shapes[1]} experts, top-k {shapes[2]}, which that "
                        f"layout cannot run on: dispatch again")
        return native

    def _relayout(self, native: NativeBuffer, layout: _Layout, num_sms: int) -> tuple:
        """Re-runs the layout of an older handle (one uncached dispatch, on the current stream:
        the comm stream) so that the window holds it again: a selection of each rank's first
        expert where is_token_in_rank says so, which sends every token to the same ranks, so
        every rank receives the same rows in the same order. Returns what the call reads."""
        x = torch.zeros((layout.num_tokens, native.hidden), dtype=torch.bfloat16,
                        device=native.device)
        idx, w = self._selections(native, None, None, layout.is_token_in_rank)
        res = native.launch_dispatch(x, False, idx, w, None, None, num_sms, None, False)
        layout.native = res.handle
        self.num_relayouts += 1
        return x, idx, w, layout.is_token_in_rank

    def _cached_dispatch(self, x, handle: Handle, num_sms: int, previous_event, async_finish,
                         allocate_on_comm_stream):
        native = self._native_of(handle, "dispatch")
        num_tokens, is_fp8 = native.check_x(x)
        layout = handle.layout
        if num_tokens != layout.num_tokens:
            raise Error(f"cached dispatch: x has {num_tokens} tokens, the handle's layout "
                        f"{layout.num_tokens}")
        rows = layout.num_rows
        comm = native.comm_stream
        if native.holds_layout(layout.native):  # the common call: all stream work in the extension
            # The rows are known: recv_x and the copy's arguments are made before the launch, so
            # that the copy kernel is queued right behind the dispatch's.
            stream = _current_raw_stream(native.device.index)
            recv_x = self._owned_x(native, is_fp8, rows, allocate_on_comm_stream)
            args = native.copy_out_args(stream=stream, comm_stream=comm.cuda_stream,
                                        async_finish=async_finish, own_x=x)
            set_copy_out_rows(args, rows, recv_x)
            native.launch_dispatch(x, is_fp8, None, None, layout.native, None, num_sms, None,
                                   False, stream, comm.cuda_stream, event_of(previous_event),
                                   async_finish, hold=True, defer_own_rows=True, copy=args)
            event = async_event(comm, [*flat(recv_x), *flat(x)]) if async_finish else _NO_EVENT
            return recv_x, None, None, None, None, event
        with self._comm_call(previous_event, async_finish, allocate_on_comm_stream) as call:
            call.keep(*self._relayout(native, layout, num_sms))
            native.launch_dispatch(x, is_fp8, None, None, layout.native, None, num_sms, None,
                                   False)
            with call.allocating():
                recv_x = self._owned_x(native, is_fp8, rows)
            native.copy_out(rows, recv_x, stream=_current_raw_stream(native.device.index))
            call.keep(*flat(recv_x), *flat(x))
        return recv_x, None, None, None, None, call.event

    @staticmethod
    def _owned_x(native: NativeBuffer, is_fp8: bool, rows: int, on_comm_stream: bool = False):
        """An empty owned recv_x (or fp8 pair) of rows rows, allocated on the current stream or
        the comm stream."""
        if on_comm_stream:
            with torch.cuda.stream(native.comm_stream):
                return Buffer._owned_x(native, is_fp8, rows)
        payload = Buffer._owned_payload(native, is_fp8, rows)
        return (payload, Buffer._owned_scales(native, rows)) if is_fp8 else payload

    # -- combine --------------------------------------------------------------------------------
    @outside_torch_function_modes
    def combine(self, x: torch.Tensor, handle: Handle,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's intranode combine (a sum, without weights): (combined_x [T, hidden] bf16,
        combined_topk_weights [T, K] fp32 or None, event). combined_topk_weights sums, per
        token, the topk_weights rows of the ranks it was sent to, exactly in fp32, on the
        device."""
        self._check_alive("combine")
        num_sms = self._num_sms(config, self.get_combine_config)
        if bias is None and no_event(previous_event) and not (async_finish or
                                                              allocate_on_comm_stream):
            result = self._plain_combine(x, handle, topk_weights, num_sms)
            if result is not None:
                return result
        native = self._native_of(handle, "combine")
        layout = handle.layout
        rows = layout.num_rows
        check_stream_options(previous_event, async_finish, allocate_on_comm_stream)
        check_tensor("x", x, (torch.bfloat16,), native.device, (None, native.hidden))
        if x.shape[0] < rows:
            raise Error(f"x has {x.shape[0]} rows, but the dispatch of this handle received "
                        f"{rows}")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, (torch.float32,), native.device,
                         (x.shape[0], None))
            if not 1 <= topk_weights.shape[1] <= native.top_k:
                raise Error(f"topk_weights has {topk_weights.shape[1]} columns; this handle's "
                            f"window takes 1 to {native.top_k}")
        biases = [] if bias is None else native.check_biases(layout.native, bias)
        # Rows past the window's capacity are a worst-case layout's padding: none was received.
        if x.shape[0] > native.capacity:
            x = x[:native.capacity]
            if topk_weights is not None:
                topk_weights = topk_weights[:native.capacity]

        def outputs():
            out = torch.empty(layout.num_tokens, native.hidden, dtype=torch.bfloat16,
                              device=native.device)
            combined_w = None if topk_weights is None else torch.empty(
                layout.num_tokens, topk_weights.shape[1], dtype=torch.float32,
                device=native.device)
            return out, combined_w

        comm = native.comm_stream
        if native.holds_layout(layout.native):  # the common call: all stream work in the extension
            if allocate_on_comm_stream:
                with torch.cuda.stream(comm):
                    out, combined_w = outputs()
            else:
                out, combined_w = outputs()
            native.launch_combine(x, layout.native, biases, out, num_sms,
                                  _current_raw_stream(native.device.index), comm.cuda_stream,
                                  event_of(previous_event), async_finish,
                                  topk_weights=topk_weights, combined_weights=combined_w)
            event = _NO_EVENT
            if async_finish:
                event = async_event(comm, [x, *biases, out, topk_weights, combined_w])
            return out, combined_w, event
        with self._comm_call(previous_event, async_finish, allocate_on_comm_stream) as call:
            call.keep(*self._relayout(native, layout, num_sms))
            with call.allocating():
                out, combined_w = outputs()
            native.launch_combine(x, layout.native, biases, out, num_sms,
                                  topk_weights=topk_weights, combined_weights=combined_w)
            call.keep(x, *biases, out, topk_weights, combined_w, layout.recv_src)
        return out, combined_w, call.event

    def _latest_layout_of(self, handle) -> Optional[NativeBuffer]:
        """The window, where handle is this Buffer's and its layout is the window's latest (a
        combine or cached dispatch then needs no re-run layout); else None."""
        native = self._native
        if type(handle) is not Handle or native is None:
            return None
        layout = handle.layout
        if layout.buffer_serial != self._serial or not native.holds_layout(layout.native):
            return None
        return native

    def _plain_combine(self, x, handle, topk_weights, num_sms: int):
        """The common combine (no bias, no event; the handle's layout the latest) with the least
        host work: the accepted case checked alone, reused arguments. None where the general
        path must run (which also raises for bad input)."""
        native = self._latest_layout_of(handle)
        if native is None:
            return None
        layout = handle.layout
        d = native._device_index
        try:
            xs = x.shape
            if not (x.dtype is _T_BF16 and len(xs) == 2 and xs[1] == native.hidden and
                    layout.num_rows <= xs[0] <= native._capacity and x.get_device() == d and
                    x.is_contiguous()):
                return None
            if topk_weights is not None:
                ws = topk_weights.shape
                if not (topk_weights.dtype is _T_F32 and len(ws) == 2 and ws[0] == xs[0] and
                        1 <= ws[1] <= native.top_k and topk_weights.get_device() == d and
                        topk_weights.is_contiguous()):
                    return None
        except AttributeError:  # not tensors
            return None
        num_tokens = layout.num_tokens
        out = torch.empty(num_tokens, native.hidden, dtype=_T_BF16, device=native.device)
        a = native.reused_args("DeepEP combine", self._combine_args, native)
        a.expert_out = x.data_ptr()
        a.expert_out_rows = xs[0]
        a.out = out.data_ptr()
        a.num_sms = num_sms
        a.stream = _current_raw_stream(d)
        combined_w = None
        if topk_weights is None:
            a.topk_weights = a.topk_weights_rows = a.topk_weights_cols = a.combined_weights = 0
        else:
            combined_w = torch.empty(num_tokens, ws[1], dtype=_T_F32, device=native.device)
            a.topk_weights = topk_weights.data_ptr()
            a.topk_weights_rows, a.topk_weights_cols = ws
            a.combined_weights = combined_w.data_ptr()
        native._native.combine(a, layout.native)
        return out, combined_w, _NO_EVENT

    def _plain_cached_dispatch(self, x, handle, num_sms: int):
        """The common cached dispatch (no event; the handle's layout the latest) with the least
        host work, as _plain_combine: recv_x made first, then one extension call (the dispatch
        kernel with this rank's own rows deferred, and the copy behind it). None where the
        general path must run."""
        native = self._latest_layout_of(handle)
        if native is None:
            return None
        layout = handle.layout
        d = native._device_index
        hidden = native.hidden
        num_tokens = layout.num_tokens
        if plain_token_rows(x, d) != (num_tokens, hidden):
            return None
        is_fp8 = isinstance(x, (tuple, list))
        rows = layout.num_rows
        stream = _current_raw_stream(d)
        kind = "DeepEP cached dispatch, fp8" if is_fp8 else "DeepEP cached dispatch"
        a, c = native.reused_args(kind, self._deferring_args, native, is_fp8, False)
        recv_x = torch.empty(rows, hidden, device=native.device,
                             dtype=torch.float8_e4m3fn if is_fp8 else _T_BF16)
        set_own_rows(a.x, c.own_x, x, is_fp8, num_tokens)
        c.x = recv_x.data_ptr()
        if is_fp8:
            recv_scales = torch.empty(rows, hidden // 128, dtype=_T_F32, device=native.device)
            c.x_scales = recv_scales.data_ptr()
            recv_x = (recv_x, recv_scales)
        c.num_rows = rows
        a.num_sms = num_sms
        a.stream = c.stream = stream
        native._native.dispatch(a, layout.native, c)
        return recv_x, None, None, None, None, _NO_EVENT

    @staticmethod
    def _combine_args(native: NativeBuffer):
        """The reused CombineArgs of _plain_combine, its constant fields set (its tensors are
        checked to be on the device: pointers_checked)."""
        a = _weft.ep.CombineArgs()
        a.comm_stream = native.comm_stream.cuda_stream
        a.pointers_checked = True
        return a


class _StreamOnly:
    """What CommCall needs of a Buffer before it has a window (get_dispatch_layout): the comm
    stream and its hand-off, with torch's events."""

    def __init__(self, comm_stream: torch.cuda.Stream, device: torch.device) -> None:
        self.comm_stream = comm_stream
        self.device = device

    def enter_comm(self, caller: torch.cuda.Stream, previous_event) -> None:
        if previous_event is not None and previous_event.event is not None:
            self.comm_stream.wait_event(previous_event.event.event)
        else:
            self.comm_stream.wait_stream(caller)

    def leave_comm(self, caller: torch.cuda.Stream) -> None:
        caller.wait_stream(self.comm_stream)
