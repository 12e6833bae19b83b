"""How long weft.plan takes to read a run's trace (report_from_trace), against json.load of the
same file, for traces of growing size (docs/python.md, weft.plan). CPU only.

    python3 bench/python/trace_read.py --steps 5000,20000,80000
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "tests"))

from test_plan_hostile import long_trace  # noqa: E402

from weft import plan  # noqa: E402


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", default="5000,20000")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(f"{'steps':>8} {'MB':>8} {'json.load s':>12} {'weft s':>8} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as d:
        for n in (int(x) for x in a.steps.split(",")):
            path = Path(d) / f"t{n}.json"
            long_trace(path, n)

            def load():
                with open(path) as f:
                    json.load(f)

            j = best_of(load, a.repeats)
            w = best_of(lambda: plan.report_from_trace(path, Path(d) / "r.html"), a.repeats)
            print(f"{n:>8} {path.stat().st_size / 1e6:>8.1f} {j:>12.3f} {w:>8.3f} {w / j:>6.2f}")


if __name__ == "__main__":
    main()
