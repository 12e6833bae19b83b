"""Host overhead of one progress() of the 14-task HSTU schedule with no-op Python bodies, under
every variant: weft.pipeline's Engine (host backend) beside a pure-Python executor with the
mechanics of the HSTU benchmark's engine (python_executor.py), in the same run. Prints the median
microseconds per progress() of each and their ratio.

--backend torch (a GPU): weft's Engine alone on its torch backend, each no-op body run as a
task's body runs there (its stream current, the Engine's device, grad mode and autocast state
set and put back): the host cost per progress() and per task that a GPU schedule adds to its
bodies' own.

    python3 bench/python/engine_overhead.py [--steps 2000] [--rounds 3] [--backend torch]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from python_executor import PythonExecutor  # noqa: E402
from weft.pipeline import HSTU_TASK_NAMES, Engine, hstu_schedule, hstu_variants  # noqa: E402


def noop(ctx):
    pass


def median_us(progress, steps: int) -> float:
    it = itertools.count()
    for _ in range(max(50, steps // 10)):  # prefill and warm-up
        progress(it)
    times = []
    clock = time.perf_counter_ns
    for _ in range(steps):
        t0 = clock()
        progress(it)
        times.append(clock() - t0)
    return statistics.median(times) / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=("host", "torch"), default="host")
    args = parser.parse_args()
    bodies = {name: noop for name in HSTU_TASK_NAMES}
    if args.backend == "torch":
        torch_backend(args, bodies)
        return
    print(f"{'variant':26s} {'weft us':>10s} {'python us':>10s} {'ratio':>7s}   "
          f"(medians over {args.steps} steps; range over {args.rounds} rounds)")
    for v in hstu_variants():
        weft_us, python_us = [], []
        for _ in range(args.rounds):
            engine = Engine(hstu_schedule(bodies, cascade=v.cascade), v.thread_map)
            weft_us.append(median_us(engine.progress, args.steps))
            engine.close()
            executor = PythonExecutor(hstu_schedule(bodies, cascade=v.cascade), v.thread_map)
            python_us.append(median_us(executor.progress, args.steps))
            executor.close()
        w, p = statistics.median(weft_us), statistics.median(python_us)
        print(f"{v.name:26s} {w:10.1f} {p:10.1f} {p / w:6.1f}x   "
              f"weft {min(weft_us):.1f}-{max(weft_us):.1f}, "
              f"python {min(python_us):.1f}-{max(python_us):.1f}",
              flush=True)


def torch_backend(args, bodies) -> None:
    import torch

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    # Per task only on the sequential executor: elsewhere tasks run on several threads at once.
    print(f"{'variant':26s} {'weft us':>10s} {'us per task':>12s}   (medians over {args.steps} "
          f"steps; range over {args.rounds} rounds)")
    num_tasks = len(HSTU_TASK_NAMES)
    for v in hstu_variants():
        weft_us = []
        for _ in range(args.rounds):
            engine = Engine(hstu_schedule(bodies, cascade=v.cascade), v.thread_map,
                            backend="torch")
            weft_us.append(median_us(engine.progress, args.steps))
            engine.close()
        w = statistics.median(weft_us)
        per_task = f"{w / num_tasks:12.2f}" if v.thread_map == "legacy" else f"{'-':>12s}"
        print(f"{v.name:26s} {w:10.1f} {per_task}   weft {min(weft_us):.1f}-"
              f"{max(weft_us):.1f}", flush=True)


if __name__ == "__main__":
    main()
