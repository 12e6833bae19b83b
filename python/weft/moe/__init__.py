"""weft.moe: a Mixture-of-Experts layer whose all-to-all is a pluggable dispatcher (weft.ep, the
NCCL all_to_all dispatcher users have today, or a local one for a single rank), with its
backward: the dispatch's backward is a combine of the gradients, the combine's a dispatch.

    layer = weft.moe.MoELayer(hidden=2048, num_experts=128, top_k=8, ffn=768,
                              dispatcher=weft.moe.EpDispatcher(weft.ep.Buffer(group, 2**31)))
    y = layer(x)            # [T, hidden] bf16; autograd through dispatch, experts, combine
"""

from .dispatchers import AllToAllDispatcher, EpDispatcher, LocalDispatcher
from .layer import MoELayer, combine, dispatch
from .model import DenseBlock, MoEModel, train_step

__all__ = ["AllToAllDispatcher", "DenseBlock", "EpDispatcher", "LocalDispatcher", "MoELayer",
           "MoEModel", "combine", "dispatch", "train_step"]
