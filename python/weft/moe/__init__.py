"""weft.moe: a Mixture-of-Experts layer whose all-to-all is a pluggable dispatcher (weft.ep, the
NCCL all_to_all dispatcher users have today, or a local one for a single rank), with its
backward: the dispatch's backward is a combine of the gradients, the combine's a dispatch.

    layer = weft.moe.MoELayer(hidden=2048, num_experts=128, top_k=8, ffn=768,
                              dispatcher=weft.moe.EpDispatcher(weft.ep.Buffer(group, 2**31), 128))
    y = layer(x)            # [T, hidden] bf16; autograd through dispatch, experts, combine

The micro-batched step (step.py): serial_step (one stream) and PipelinedStep (weft.pipeline),
forward and backward cut into stages at every communication, with one dispatcher per live layout
(slots.py). EmulatedDispatcher (emulated.py): on one GPU, a dispatcher that holds the SMs of a
target machine's communication for the time it takes there. ops.py: dispatch and combine as
torch.library custom ops, through which torch.compile traces the layer into one graph.
planning.py: the planner over the step (its depth variants, costs from a traced step, a search
kept to the step's layouts; no torch).
"""

from .dispatchers import AllToAllDispatcher, EpDispatcher, LocalDispatcher, NativeEpDispatcher
from .emulated import A2A_2XH200, EP_2XH200, CallCost, EmulatedDispatcher
from .layer import MoELayer, combine, dispatch
from .model import DenseBlock, MoEModel, train_step
from .slots import LayoutSlots
from .step import (STAGES, PipelinedStep, default_dispatch_after_router, default_num_threads,
                   dispatches_after_routers, max_depth, moe_costs, moe_schedule, moe_thread_map,
                   num_layout_slots, serial_step, stage_lookaheads)

__all__ = ["A2A_2XH200", "AllToAllDispatcher", "CallCost", "DenseBlock", "EP_2XH200",
           "EmulatedDispatcher", "EpDispatcher", "LayoutSlots", "LocalDispatcher",
           "MoELayer", "MoEModel", "NativeEpDispatcher", "PipelinedStep", "STAGES", "combine",
           "default_dispatch_after_router", "default_num_threads", "dispatch",
           "dispatches_after_routers", "max_depth",
           "moe_costs", "moe_schedule", "moe_thread_map", "num_layout_slots", "serial_step",
           "stage_lookaheads", "train_step"]
