"""The HSTU training step (weft.hstu.tasks) under the nine HSTU variants of weft.pipeline's engine
and loader_split_d6 (weft.hstu.variants), and as a plain Python loop, in one run: step time, its
ratio to the loop's, default-stream busy %, engine overhead, the planner's prediction and its
error; losses and final parameters checked bit for bit against the loop's (the exit status is 1
if any differ). With --suggest, also the schedule weft.plan.suggest finds for the measured costs
(weft.hstu.planning), run as the variant "suggested".

    python bench/python/hstu_step.py --config host-bound          # one GPU, a group of one
    python bench/python/hstu_step.py --config host-bound --suggest [--calibrate]
    python bench/python/hstu_step.py --config gpu-bound --device cpu
    python bench/python/hstu_step.py --schedule-config hstu_host-bound_suggested.json
    torchrun --nproc-per-node 2 bench/python/hstu_step.py --config gpu-bound

First one traced run of each (not timed): the loop's, then legacy_none's, whose trace gives the
planner its costs (each task's median host span and, per stream, its median GPU busy time: the
GPU span less the waits inside it, weft.plan.trace_costs; --gpu-costs span: the span itself;
rank 0's, on every rank), then the other variants'. From them:
 - busy %: the union of the engine trace's GPU spans on the default stream (CUDA events at each
   body's start and end on its stream, so an upper bound: a span includes the stream's idle time
   while its body enqueues) over the traced run's wall time; the loop's from events around each
   body the same way. CUDA only.
 - engine overhead: the wall time of the traced progress() calls minus the union of the trace's
   host spans (time in progress() when no body ran on any thread), per step.
 - planner ms: weft.plan.simulate of the variant with those costs; err %: its error against the
   median of the timed runs' step (above 0: it predicts more time than was measured).
 - --calibrate: the thread wake-up cost and GIL model (weft.plan's wake_up_us, gil) under which
   the planner best matches the traced runs' steps (weft.hstu.planning.fit_calibration); fit ms
   and fit err % are its predictions and their errors.
 - --suggest: weft.plan.suggest over the d6 step schedule with those costs (and the fit, with
   --calibrate; at most --max-threads threads, lookaheads within the schedule's, h2d on either
   of its streams); the best suggestion's config is written to --config-out, and runs, traced and
   timed, as "suggested".
Then the timed runs: --warmup steps, then --iters timed steps (the wall time of their progress()
calls over --iters, the device synchronised at both ends; each one a steady-state step that runs
every task once), then the rest drained untimed; ranges over --repeats runs, the loop and the
variants interleaved. The table's last line is the root mean square of the planner's errors over
the engine rows (and of the fitted ones).
Progress goes to stderr, the table to stdout (rank 0).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: determinism

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from typing import Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from launch import rank0_value, world_group  # noqa: E402
from weft.hstu.planning import (error_pct, fit_calibration, predicted_ms,  # noqa: E402
                                rms_error_pct, suggest_variant, variant_from_config)
from weft.hstu.step import (CONFIGS, OVERRIDES, Run, measured_costs,  # noqa: E402
                            run_once, same_bits, trace_figures)
from weft.hstu.variants import StepVariant, step_variants  # noqa: E402

LOOP = "plain loop"
CALIBRATION = "legacy_none"  # the variant whose traced run gives the planner its costs


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _gpu_ms(costs: dict) -> float:
    """The sum of a cost model's GPU segments, in ms."""
    return sum(g["us"] for t in costs["tasks"].values() for g in t.get("gpu", [])) / 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", choices=["gpu-bound", "host-bound"], default="host-bound")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="all", help="comma-separated HSTU variant names")
    p.add_argument("--suggest", action="store_true",
                   help="run the schedule weft.plan.suggest finds for the measured costs too")
    p.add_argument("--max-threads", type=int, default=4, help="--suggest: the thread bound")
    p.add_argument("--gpu-costs", choices=["busy", "span"], default="busy",
                   help="the planner's GPU cost of a task: its busy time (the span less the "
                        "waits inside it) or its whole span (docs/planner.md)")
    p.add_argument("--calibrate", action="store_true",
                   help="fit a thread wake-up cost and the GIL model to the traced runs' steps; "
                        "the planner's fitted prediction is shown too, and --suggest uses it")
    p.add_argument("--config-out",
                   help="--suggest: where the suggestion's schedule config goes (default "
                        "hstu_CONFIG_suggested.json in --trace-dir, else here)")
    p.add_argument("--schedule-config", action="append", default=[], metavar="FILE",
                   help="a variant from a schedule config (a thread map, lookaheads, streams: "
                        "what --suggest writes) over the d6 schedule; repeatable")
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
    every = {v.name: v for v in step_variants()}
    variants = [v for v in every.values()
                if a.variants == "all" or v.name in a.variants.split(",")]
    variants += [variant_from_config(path) for path in a.schedule_config]
    names = [v.name for v in variants] + (["suggested"] if a.suggest else [])
    if len(set(names)) != len(names):
        p.error(f"two variants of one name among {names} (rename a --schedule-config file)")
    if any(v.name == CALIBRATION and v is not every[CALIBRATION] for v in variants):
        p.error(f"a --schedule-config may not be named {CALIBRATION} (the preset traced for the "
                f"costs has that name): rename the file")
    out = print if rank == 0 else (lambda *_: None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out(f"# hstu_step --config {a.config}: {name} x {world}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {a.warmup} + {a.iters} steps per run, {a.repeats} runs")
    out(f"# {config}")
    same: Dict[str, bool] = {}
    reference: Optional[Run] = None

    def measure(v: Optional[StepVariant], traced: bool) -> Run:
        nonlocal reference
        key = LOOP if v is None else v.name
        run = run_once(config, group, device, v, a.warmup, a.iters, traced)
        if reference is None:
            reference = run
        same[key] = same.get(key, True) and same_bits(run, reference)
        if run is not reference:
            run.params = None
        return run

    traced: Dict[str, Run] = {}

    def trace(v: Optional[StepVariant]) -> None:
        key = LOOP if v is None else v.name
        traced[key] = measure(v, True)
        log(f"[rank {rank}] traced {key}: {traced[key].step_ms:.2f} ms/step")
        if a.trace_dir and traced[key].trace is not None:
            os.makedirs(a.trace_dir, exist_ok=True)
            traced[key].trace.write_chrome_json(os.path.join(
                a.trace_dir, f"hstu_{a.config}_{key}_rank{rank}.trace.json"))

    trace(None)  # the loop's run first: the reference every other run's bits are checked against
    trace(every[CALIBRATION])
    costs = rank0_value(measured_costs(traced[CALIBRATION].trace, every[CALIBRATION].schedule(),
                                       a.gpu_costs), group)
    spans = measured_costs(traced[CALIBRATION].trace, gpu="span")
    out(f"# costs: {CALIBRATION}'s traced run, GPU {a.gpu_costs} time per task: "
        f"{_gpu_ms(costs):.2f} ms of GPU work per step (the spans: {_gpu_ms(spans):.2f} ms)")
    for v in variants:
        if v.name not in traced:
            trace(v)
    engine_variants = [every[CALIBRATION]] + [v for v in variants if v.name != CALIBRATION]
    fit = None
    if a.calibrate:
        traced_ms = rank0_value({k: r.step_ms for k, r in traced.items() if k != LOOP}, group)
        fit = fit_calibration(traced_ms, engine_variants, costs)
        out(f"# calibration, fitted on the traced runs of {len(engine_variants)} variants: "
            f"{fit.describe()} (rms error there {fit.rms_error_pct:.1f}%, uncalibrated "
            f"{rms_error_pct(traced_ms, engine_variants, costs):.1f}%)")
    if a.suggest:
        found = suggest_variant(costs, max_threads=a.max_threads, calibration=fit)
        log(str(found.result))
        path = a.config_out or os.path.join(a.trace_dir or ".",
                                            f"hstu_{a.config}_suggested.json")
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            found.suggestion.write_config(path)
        out(f"# suggested ({found.result.method} search, {found.result.num_evaluated} schedules "
            f"simulated; config in {path}): {found.suggestion.num_threads} "
            f"thread{'s' if found.suggestion.num_threads > 1 else ''}, "
            f"bound: {found.suggestion.bound}")
        variants.append(found.variant)
        trace(found.variant)
    runs: Dict[str, List[Run]] = {LOOP: []}
    runs.update({v.name: [] for v in variants})
    for r in range(a.repeats):
        for v in [None] + variants:
            key = LOOP if v is None else v.name
            runs[key].append(measure(v, False))
            log(f"[rank {rank}] run {r + 1}/{a.repeats} {key}: {runs[key][-1].step_ms:.2f} ms/step")
    loop_ms = [x.step_ms for x in runs[LOOP]]
    by_name = {v.name: v for v in variants}
    mismatches = 0
    fit_header = f" {'fit ms':>7s} {'fit err %':>9s}" if fit else ""
    out(f"{'variant':24s} {'step ms':>15s} {'x loop':>11s} {'busy %':>7s} "
        f"{'overhead us':>11s} {'planner ms':>10s} {'err %':>7s}{fit_header}  bits")
    for key, rs in runs.items():
        ms = [x.step_ms for x in rs]
        mismatches += 0 if same[key] else 1
        busy, overhead = trace_figures(traced[key], traced[key].step_ms, a.iters)
        columns = []
        for calibration in [None] + ([fit] if fit else []):
            predicted = None if key == LOOP else predicted_ms(by_name[key], costs, calibration)
            error = None if predicted is None else error_pct(predicted, statistics.median(ms))
            columns += [predicted, error]
        ratio = f"{min(ms) / max(loop_ms):.2f}-{max(ms) / min(loop_ms):.2f}"
        fitted = (f" {_fmt(columns[2], '7.2f'):>7s} {_fmt(columns[3], '+9.1f'):>9s}"
                  if fit else "")
        out(f"{key:24s} {min(ms):7.2f}-{max(ms):<7.2f} {ratio:>11s} {_fmt(busy, '7.1f'):>7s} "
            f"{_fmt(overhead, '11.1f'):>11s} {_fmt(columns[0], '10.2f'):>10s} "
            f"{_fmt(columns[1], '+7.1f'):>7s}{fitted}  {'identical' if same[key] else 'DIFFERENT'}")
    timed_ms = {key: statistics.median(x.step_ms for x in rs) for key, rs in runs.items()}
    rows = [by_name[key] for key in runs if key != LOOP]
    out(f"# planner error over the {len(rows)} engine rows (timed medians): rms "
        f"{rms_error_pct(timed_ms, rows, costs):.1f}%"
        + (f", calibrated {rms_error_pct(timed_ms, rows, costs, fit):.1f}%" if fit else ""))
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
