"""One HSTU training step run (weft.hstu.tasks) under a variant of the engine, or as the plain
loop, timed; and what a run's trace says (default-stream busy %, engine overhead, a cost model
for the planner). bench/python/hstu_step.py is the command line over it (docs/python.md).

    run = run_once(CONFIGS[("host-bound", "cpu")], group, torch.device("cpu"), variant,
                   warmup=3, iters=10, traced=False)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import plan
from ..pipeline import Engine
from .data import ZipfLoader
from .tasks import HstuConfig, HstuStep
from .variants import StepVariant

__all__ = ["CONFIGS", "DRAIN_BATCHES", "OVERRIDES", "Run", "measured_costs", "run_once",
           "same_bits", "synchronize", "trace_figures", "union_us"]

# (config, device type) -> sizes. GPU-bound: a big dense model, light preprocessing. Host-bound:
# many raw events per token to sort and a small model, so collate() and the host syncs dominate.
CONFIGS = {
    ("gpu-bound", "cuda"): HstuConfig(
        batch_size=64, max_seq_len=512, num_items=1_000_000, num_actions=32, dim=512,
        num_layers=4, num_heads=8, head_dim=64, mlp_dim=2048, num_negatives=2048,
        events_per_token=1, bf16=True),
    ("host-bound", "cuda"): HstuConfig(
        batch_size=64, max_seq_len=128, num_items=1_000_000, num_actions=32, dim=128,
        num_layers=2, num_heads=4, head_dim=32, mlp_dim=512, num_negatives=512,
        events_per_token=16, bf16=True),
    ("gpu-bound", "cpu"): HstuConfig(
        batch_size=8, max_seq_len=64, num_items=100_000, dim=64, num_layers=2, num_heads=2,
        head_dim=32, mlp_dim=256, num_negatives=256, events_per_token=1),
    ("host-bound", "cpu"): HstuConfig(
        batch_size=16, max_seq_len=32, num_items=100_000, dim=32, num_layers=1, num_heads=2,
        head_dim=16, mlp_dim=64, num_negatives=64, events_per_token=256),
}
OVERRIDES = ["batch_size", "max_seq_len", "num_items", "dim", "num_layers", "num_heads",
             "head_dim", "mlp_dim", "num_negatives", "events_per_token"]
DRAIN_BATCHES = 5  # the largest lookahead of the two cascades


@dataclasses.dataclass
class Run:
    step_ms: float
    losses: List[torch.Tensor]
    params: Optional[Dict[str, torch.Tensor]]  # dropped once compared with the loop's
    progress_us: List[float]
    trace: object = None            # the engine's Trace (traced engine runs)
    body_gpu: Optional[list] = None  # (start, end) CUDA event pairs (traced loop runs)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_bodies(bodies: dict, events: list) -> dict:
    """Bodies that record CUDA events around themselves on the current stream."""
    def timed(fn):
        def body(ctx):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(ctx)
            end.record()
            events.append((start, end))
        return body
    return {name: timed(fn) for name, fn in bodies.items()}


def run_once(config: HstuConfig, group, device: torch.device, variant: Optional[StepVariant],
             warmup: int, iters: int, traced: bool) -> Run:
    """One run: warmup steps, then iters timed ones, then the rest drained untimed. Every run
    takes DRAIN_BATCHES more batches than it times, so that each timed progress() of either
    cascade is a steady-state one (it runs every task once, for its own batch)."""
    step = HstuStep(config, group, device)
    num_batches = warmup + iters + DRAIN_BATCHES
    batches = iter(ZipfLoader(num_batches))
    events: list = []
    if variant is None:
        bodies = timed_bodies(step.bodies(), events) if traced and device.type == "cuda" \
            else step.bodies()
        results = step.sequential(batches, bodies)
        progress, engine = (lambda: next(results)), None
    else:
        engine = Engine(variant.schedule(step.bodies()), variant.thread_map,
                        backend="torch" if device.type == "cuda" else "host", trace=traced)
        progress = lambda: engine.progress(batches)  # noqa: E731
    losses = [progress() for _ in range(warmup)]
    synchronize(device)
    dist.barrier(group)
    events.clear()
    if engine is not None and traced:
        engine.take_trace()
    progress_us = []
    clock = time.perf_counter
    t0 = clock()
    for _ in range(iters):
        t = clock()
        losses.append(progress())
        progress_us.append((clock() - t) * 1e6)
    synchronize(device)
    step_ms = (clock() - t0) * 1e3 / iters
    trace = engine.take_trace() if engine is not None and traced else None
    gpu = list(events) if events else None
    losses += [progress() for _ in range(num_batches - warmup - iters)]
    if engine is not None:
        engine.close()
    return Run(step_ms, [x.detach().cpu() for x in losses], step.parameters(), progress_us,
               trace, gpu)


def union_us(spans) -> float:
    """The length of the union of (begin, end) intervals."""
    total, end = 0.0, float("-inf")
    for b, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(b, end)
        end = e
    return total


def trace_figures(run: Run, wall_ms: float, iters: int):
    """(default-stream busy %, engine overhead us per step) of a traced run."""
    busy = None
    if run.trace is not None:
        t = run.trace
        default = t.stream_names.index("default") if "default" in t.stream_names else -1
        gpu = [(s.begin_us, s.end_us) for s in t.gpu_spans if s.stream == default]
        if gpu:
            busy = 100.0 * union_us(gpu) / (wall_ms * 1e3 * iters)
        host = union_us([(s.begin_us, s.end_us) for s in t.host_spans])
        return busy, (sum(run.progress_us) - host) / iters
    if run.body_gpu:
        gpu_ms = sum(s.elapsed_time(e) for s, e in run.body_gpu)
        busy = 100.0 * gpu_ms / (wall_ms * iters)
    return busy, None


def measured_costs(trace, schedule=None, gpu: str = "busy") -> dict:
    """A cost model (docs/planner.md "Cost files") from a trace: per task its median host span
    and, per stream, its median GPU busy time (``gpu="busy"``: the span less the waits inside
    it that the trace shows, weft.plan.trace_costs; ``schedule``, the traced schedule, names the
    producers waited for) or its median GPU span (``gpu="span"``)."""
    return plan.trace_costs(trace, schedule, gpu=gpu)


def same_bits(a: Run, b: Run) -> bool:
    return (len(a.losses) == len(b.losses)
            and all(torch.equal(x, y) for x, y in zip(a.losses, b.losses))
            and a.params.keys() == b.params.keys()
            and all(torch.equal(a.params[k], b.params[k]) for k in a.params))
