"""The HSTU training step (hstu_tasks.py) under the nine HSTU variants of weft.pipeline's engine
and loader_split_d6 (hstu_variants.py), and as a plain Python loop, in one run: step time, its
ratio to the loop's, default-stream busy %, engine overhead and the planner's prediction; losses
and final parameters checked bit for bit against the loop's (the exit status is 1 if any
differ).

    python bench/python/hstu_step.py --config host-bound          # one GPU, a group of one
    python bench/python/hstu_step.py --config gpu-bound --device cpu
    torchrun --nproc-per-node 2 bench/python/hstu_step.py --config gpu-bound

Per run: --warmup steps, then --iters timed steps (the wall time of their progress() calls over
--iters, the device synchronised at both ends; each one a steady-state step that runs every task
once), then the rest drained untimed; ranges over --repeats runs, the loop and the variants
interleaved. Then one traced run each (not timed):
 - busy %: the union of the engine trace's GPU spans on the default stream (CUDA events at each
   body's start and end on its stream, so an upper bound: a span includes the stream's idle time
   while its body enqueues) over the traced run's wall time; the loop's from events around each
   body the same way. CUDA only.
 - engine overhead: the wall time of the traced progress() calls minus the union of the trace's
   host spans (time in progress() when no body ran on any thread), per step.
 - planner: weft.plan.simulate of the variant with costs from the traced legacy_none run (each
   task's median host span, its median GPU span per stream).
Progress goes to stderr, the table to stdout (rank 0).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: determinism

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hstu_data import ZipfLoader  # noqa: E402
from hstu_tasks import HstuConfig, HstuStep  # noqa: E402
from launch import world_group  # noqa: E402
from weft import plan  # noqa: E402
from hstu_variants import StepVariant, step_variants  # noqa: E402
from weft.pipeline import Engine  # noqa: E402

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
LOOP = "plain loop"
DRAIN_BATCHES = 5  # the largest lookahead of the two cascades


@dataclasses.dataclass
class Run:
    step_ms: float
    losses: List[torch.Tensor]
    params: Optional[Dict[str, torch.Tensor]]  # dropped once compared with the loop's
    progress_us: List[float]
    trace: object = None            # the engine's Trace (traced engine runs)
    body_gpu: Optional[list] = None  # (start, end) CUDA event pairs (traced loop runs)


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


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


def measured_costs(trace) -> dict:
    """A cost model (docs/planner.md "Cost files") from a trace: per task its median host span
    and its median GPU span per stream."""
    tasks: Dict[str, dict] = {}
    for i, name in enumerate(trace.task_names):
        host = [s.end_us - s.begin_us for s in trace.host_spans if s.task == i]
        if not host:
            continue
        entry = {"host_us": statistics.median(host)}
        gpu = []
        for j, stream in enumerate(trace.stream_names):
            us = [s.end_us - s.begin_us for s in trace.gpu_spans if s.task == i and s.stream == j]
            if us:
                gpu.append({"stream": stream, "us": statistics.median(us)})
        if gpu:
            entry["gpu"] = gpu
        tasks[name] = entry
    return {"default_host_us": 0, "tasks": tasks}


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def same_bits(a: Run, b: Run) -> bool:
    return (len(a.losses) == len(b.losses)
            and all(torch.equal(x, y) for x, y in zip(a.losses, b.losses))
            and a.params.keys() == b.params.keys()
            and all(torch.equal(a.params[k], b.params[k]) for k in a.params))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", choices=["gpu-bound", "host-bound"], default="host-bound")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="all", help="comma-separated HSTU variant names")
    p.add_argument("--trace-dir", help="write each traced engine run's Chrome trace here")
    p.add_argument("--switch-interval-ms", type=float,
                   help="sys.setswitchinterval: how soon a thread that waits for the GIL gets it")
    p.add_argument("--torch-threads", type=int,
                   help="torch.set_num_threads (CPU: 1 leaves the other cores to the host work, "
                        "as a GPU would)")
    for name in OVERRIDES:
        p.add_argument("--" + name.replace("_", "-"), type=int)
    a = p.parse_args()
    torch.use_deterministic_algorithms(True)
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    if a.switch_interval_ms:
        sys.setswitchinterval(a.switch_interval_ms / 1e3)
    device = torch.device(a.device)
    group = world_group(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rank, world = group.rank(), group.size()
    config = dataclasses.replace(CONFIGS[(a.config, device.type)],
                                 **{k: getattr(a, k) for k in OVERRIDES
                                    if getattr(a, k) is not None})
    variants = [v for v in step_variants()
                if a.variants == "all" or v.name in a.variants.split(",")]
    out = print if rank == 0 else (lambda *_: None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out(f"# hstu_step --config {a.config}: {name} x {world}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {a.warmup} + {a.iters} steps per run, {a.repeats} runs")
    out(f"# {config}")
    runs: Dict[str, List[Run]] = {LOOP: []}
    runs.update({v.name: [] for v in variants})
    same = {key: True for key in runs}
    reference: Optional[Run] = None

    def measure(v: Optional[StepVariant], traced: bool) -> Run:
        nonlocal reference
        key = LOOP if v is None else v.name
        run = run_once(config, group, device, v, a.warmup, a.iters, traced)
        if reference is None:
            reference = run
        same[key] = same[key] and same_bits(run, reference)
        if run is not reference:
            run.params = None
        return run

    for r in range(a.repeats):
        for v in [None] + variants:
            key = LOOP if v is None else v.name
            runs[key].append(measure(v, False))
            log(f"[rank {rank}] run {r + 1}/{a.repeats} {key}: {runs[key][-1].step_ms:.2f} ms/step")
    traced = {}
    for v in [None] + variants:
        key = LOOP if v is None else v.name
        traced[key] = measure(v, True)
        log(f"[rank {rank}] traced {key}: {traced[key].step_ms:.2f} ms/step")
        if a.trace_dir and traced[key].trace is not None:
            os.makedirs(a.trace_dir, exist_ok=True)
            traced[key].trace.write_chrome_json(os.path.join(
                a.trace_dir, f"hstu_{a.config}_{key}_rank{rank}.trace.json"))
    costs = measured_costs(traced["legacy_none"].trace) if "legacy_none" in traced else None
    loop_ms = [x.step_ms for x in runs[LOOP]]
    mismatches = 0
    out(f"{'variant':24s} {'step ms':>15s} {'x loop':>11s} {'busy %':>7s} "
        f"{'overhead us':>11s} {'planner ms':>10s}  bits")
    for key, rs in runs.items():
        ms = [x.step_ms for x in rs]
        mismatches += 0 if same[key] else 1
        busy, overhead = trace_figures(traced[key], traced[key].step_ms, a.iters)
        predicted = None
        if key != LOOP and costs is not None:
            v = next(v for v in variants if v.name == key)
            predicted = plan.simulate(v.schedule(), v.thread_map, costs,
                                      name=key).timeline.step_us / 1e3
        ratio = f"{min(ms) / max(loop_ms):.2f}-{max(ms) / min(loop_ms):.2f}"
        out(f"{key:24s} {min(ms):7.2f}-{max(ms):<7.2f} {ratio:>11s} {_fmt(busy, '7.1f'):>7s} "
            f"{_fmt(overhead, '11.1f'):>11s} {_fmt(predicted, '10.2f'):>10s}  "
            f"{'identical' if same[key] else 'DIFFERENT'}")
    flag = torch.tensor([mismatches], device=device)
    dist.all_reduce(flag, group=group)  # any rank's mismatch fails every rank
    mismatches = int(flag.item())
    out(f"# losses of the loop, rank 0: first {reference.losses[0].item():.6f}, "
        f"last {reference.losses[-1].item():.6f}; "
        f"{'every run bit-identical to the loop' if mismatches == 0 else 'MISMATCH'}")
    dist.destroy_process_group()
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
