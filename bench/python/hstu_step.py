"""The HSTU training step (weft.hstu.tasks) under the nine HSTU variants of weft.pipeline's engine
and loader_split_d6 (weft.hstu.variants), and as a plain Python loop, in one run: step time, its
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
import sys  # noqa: E402
from typing import Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from launch import world_group  # noqa: E402
from weft import plan  # noqa: E402
from weft.hstu.step import (CONFIGS, OVERRIDES, Run, measured_costs, run_once,  # noqa: E402
                            same_bits, trace_figures)
from weft.hstu.variants import StepVariant, step_variants  # noqa: E402

LOOP = "plain loop"


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


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
