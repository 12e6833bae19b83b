"""Emulated communication on one GPU: a dispatcher that moves the data as its inner dispatcher
does at one rank (weft.ep's real data path, or the all_to_all dispatcher's) and then, on the
current stream (the comm stream in a pipelined step), holds the SMs the communication would use
for the time the call takes on a target machine. So the compute of a one-GPU step meets
communication of the target's length on the target's SMs, without the second GPU. Every figure
taken with it is an emulated one.

    d = EmulatedDispatcher(EpDispatcher(weft.ep.Buffer(None, 0, max_tokens=1024), 128),
                           EP_2XH200, num_sms=weft.ep.Buffer.num_sms)
    slots = LayoutSlots(lambda layer, s: EmulatedDispatcher(...), num_slots)

A call's time is CallCost.us(rows, hidden): affine in the rows it moves, the per-row part scaled
by the row's bytes against the measured rows' (hidden 7168, bf16). The inner call's own time at
one rank (a local copy) comes on top of the hold. comm_stage_us and predict_step_us give the
planner's prediction of the step on the target from the same tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import torch

from .dispatchers import begin_dispatch

REFERENCE_HIDDEN = 7168  # the rows the tables below were measured with: bf16 [T, 7168]


@dataclass(frozen=True)
class CallCost:
    """fixed_us + us_per_row x rows x hidden / REFERENCE_HIDDEN."""

    fixed_us: float
    us_per_row: float

    def us(self, rows: int, hidden: int) -> float:
        return self.fixed_us + self.us_per_row * rows * hidden / REFERENCE_HIDDEN


def _affine(rows_a: int, us_a: float, rows_b: int, us_b: float) -> CallCost:
    slope = (us_b - us_a) / (rows_b - rows_a)
    return CallCost(us_a - slope * rows_a, slope)


# weft.ep on 2x H200: the line through the mid-ranges at T = 128 and T = 8192 tokens per rank
# (bf16 hidden 7168, top-8 of 256) of docs/perf-ep.md's current-kernels table.
EP_2XH200: Mapping[str, CallCost] = {
    "dispatch": _affine(128, 16.75, 8192, 343.2),
    "combine": _affine(128, 18.8, 8192, 344.85),
    "dispatch_cached": _affine(128, 12.85, 8192, 332.05),
}

# The NCCL all_to_all dispatcher on 2x H200: proportional to the rows through its mid-ranges at
# T = 8192 (docs/python.md, "Emulated communication"); its cached dispatch is one all_to_all of
# rows, taken as the dispatch's time. The fixed part its T = 128 figures show is left out: it is
# mostly host work and the sizes wait, which the inner call's one-rank data path brings itself.
A2A_2XH200: Mapping[str, CallCost] = {
    "dispatch": CallCost(0.0, 897.5 / 8192),
    "combine": CallCost(0.0, 1714.5 / 8192),
    "dispatch_cached": CallCost(0.0, 897.5 / 8192),
}


def remote_ranks_per_token(num_ranks: int, num_experts: int = 256, top_k: int = 8) -> float:
    """The expected number of other ranks a token's rows go to when its top_k distinct experts
    are drawn uniformly from num_experts split evenly over num_ranks: weft.ep's (deduplicated)
    sends per token over NVLink."""
    per_rank = num_experts // num_ranks
    missed = math.comb(num_experts - per_rank, top_k) / math.comb(num_experts, top_k)
    return (num_ranks - 1) * (1.0 - missed)


def _per_row_scaled(table: Mapping[str, CallCost], factor: float) -> Mapping[str, CallCost]:
    return {call: CallCost(c.fixed_us, c.us_per_row * factor) for call, c in table.items()}


# 8x H200, a MODEL (no 8-GPU figure has been measured): each call bound by the rows a GPU sends
# over NVLink at the per-GPU rate measured on 2x H200 (NVSwitch gives each GPU the same links
# whatever the number of peers), the fixed part as on 2x H200. weft.ep sends a row per token and
# destination rank (remote_ranks_per_token: 0.996 at 2 ranks, 4.62 at 8, top-8 of 256); the
# all_to_all dispatcher a row per selection, (R - 1) / R of them remote. Optimistic where the
# per-GPU rate falls with more peers or the fixed part grows with them.
EP_8XH200_MODEL = _per_row_scaled(EP_2XH200,
                                  remote_ranks_per_token(8) / remote_ranks_per_token(2))
A2A_8XH200_MODEL = _per_row_scaled(A2A_2XH200, (7 / 8) / (1 / 2))

TARGETS = {"2xh200": {"weft.ep": EP_2XH200, "a2a": A2A_2XH200},
           "8xh200-model": {"weft.ep": EP_8XH200_MODEL, "a2a": A2A_8XH200_MODEL}}


def hold_on_current_stream(num_sms: int, duration_us: float, device: torch.device) -> None:
    """weft's hold_sms kernel on torch's current stream of device."""
    from weft import _weft

    if not hasattr(_weft, "cuda") or not hasattr(_weft.cuda, "hold_sms"):
        raise RuntimeError("emulated communication needs weft built with CUDA (weft._weft.cuda)")
    stream = torch.cuda.current_stream(device)
    _weft.cuda.hold_sms(num_sms, duration_us, stream.cuda_stream, device.index)


class EmulatedDispatcher:
    """inner's calls (same results, same bits), each followed by a hold of num_sms SMs for
    costs[call].us(rows, hidden) on the current stream, rows x hidden the shape of the call's
    input (a dispatch's tokens, a combine's received rows). hold(num_sms, us, device) replaces
    the kernel (a test's recorder). held_us sums the holds so far (emulated communication time,
    for one dispatcher's calls)."""

    def __init__(self, inner, costs: Mapping[str, CallCost], num_sms: int,
                 hold: Optional[Callable[[int, float, torch.device], None]] = None) -> None:
        missing = {"dispatch", "combine", "dispatch_cached"} - set(costs)
        if missing:
            raise ValueError(f"costs lack {sorted(missing)}")
        if not isinstance(num_sms, int) or num_sms < 1:
            raise ValueError(f"num_sms must be an int >= 1, got {num_sms!r}")
        self.inner, self.costs, self.num_sms = inner, dict(costs), num_sms
        self.hold = hold or hold_on_current_stream
        self.held_us = 0.0
        self.keeps_layouts = inner.keeps_layouts
        self.comm_waits_on_host = getattr(inner, "comm_waits_on_host", True)
        self.dispatch_waits_for_layout = getattr(inner, "dispatch_waits_for_layout", False)
        self.num_ranks, self.rank = inner.num_ranks, inner.rank
        self.num_local_experts = inner.num_local_experts
        if hasattr(inner, "layout_begin"):  # the layout is the inner's (no hold: no transfer)
            self.layout_begin = inner.layout_begin

    def _hold(self, call: str, rows_of: torch.Tensor) -> None:
        us = self.costs[call].us(rows_of.shape[0], rows_of.shape[1])
        self.held_us += us
        self.hold(self.num_sms, us, rows_of.device)

    def dispatch(self, x, topk_idx, topk_weights, layout=None):
        out = begin_dispatch(self.inner, x, topk_idx, topk_weights, layout).finish()
        self._hold("dispatch", x)
        return out

    def dispatch_begin(self, x, topk_idx, topk_weights, layout=None):
        begun = begin_dispatch(self.inner, x, topk_idx, topk_weights, layout)
        self._hold("dispatch", x)
        return begun

    def combine(self, y, handle, weights=None):
        out = self.inner.combine(y, handle, weights)
        self._hold("combine", y)
        return out

    def dispatch_cached(self, x, handle):
        out = self.inner.dispatch_cached(x, handle)
        self._hold("dispatch_cached", x)
        return out


def comm_stage_us(costs: Mapping[str, CallCost], tokens: int, hidden: int) -> dict:
    """The four comm stages' times for one micro-batch of `tokens` tokens at one rank of the
    target (costs: a table above), as moe_costs takes them: dispatch and combine_bwd (a cached
    dispatch) move the tokens' rows out, combine and dispatch_bwd (a combine) bring them back."""
    return {"dispatch": costs["dispatch"].us(tokens, hidden),
            "combine": costs["combine"].us(tokens, hidden),
            "combine_bwd": costs["dispatch_cached"].us(tokens, hidden),
            "dispatch_bwd": costs["combine"].us(tokens, hidden)}


def predict_step_us(num_layers: int, depths, compute_us: Mapping[str, float],
                    comm_us: Mapping[str, float],
                    host_us: Union[float, Mapping[str, float]] = 20.0,
                    num_micro_batches: int = 0, update_us: float = 0.0,
                    num_threads: int = 2, dispatch_after_router: bool = False,
                    waits: Optional[Mapping[str, str]] = None) -> dict:
    """Depth -> the planner's time (weft.plan.simulate over moe_schedule with moe_costs) of a
    step of num_micro_batches micro-batches, its fill and drain included (0: of one micro-batch
    in steady state): compute_us the compute stages' GPU times, comm_us the comm stages'
    (comm_stage_us, or measured). host_us and waits: moe_costs' (one host time for every task
    or one per stage; the host waits for GPU work). update_us: the optimizer's update, which
    every schedule runs after its last micro-batch, alone (a whole step's tail:
    num_micro_batches > 0); at a large model it is a pass over every weight and gradient, no
    small part of the step. num_threads: the engine threads of the pipelined step
    (moe_thread_map). dispatch_after_router: the schedule family's (stage_lookaheads)."""
    from weft import plan
    from .step import moe_costs, moe_schedule, moe_thread_map

    if update_us and not num_micro_batches:
        raise ValueError("update_us is a whole step's tail: give num_micro_batches")
    costs = moe_costs(num_layers, {**compute_us, **comm_us}, host_us, waits)
    thread_map = moe_thread_map(num_layers, num_threads)
    return {d: plan.simulate(moe_schedule(num_layers, d,
                                          dispatch_after_router=dispatch_after_router),
                             thread_map, costs,
                             num_batches=num_micro_batches).timeline.step_us + update_us
            for d in depths}
