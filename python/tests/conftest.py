import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # ep_reference


def num_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    return pytest.mark.skipif(num_gpus() < n, reason=f"needs {n} GPU(s), found {num_gpus()}")


def drain(engine, data):
    """Every result of a weft.pipeline Engine over data, until StopIteration."""
    it = iter(data)
    out = []
    while True:
        try:
            out.append(engine.progress(it))
        except StopIteration:
            return out


def _rank_main(fn, rank, world_size, store_path, backend, pg_timeout_s, args):
    import datetime

    import torch.distributed as dist

    # A collective that never pairs up raises after pg_timeout_s instead of blocking forever.
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size, store_path, *args, backend="gloo", timeout_s=120,
              pg_timeout_s=60):
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in a
    torch.distributed group (``backend``, a file store at ``store_path``, collectives timing out
    after pg_timeout_s); fn is a module-level function. Fails if a rank exits non-zero (its
    traceback is on stderr) or if the ranks are not done within timeout_s (the hung ones are
    killed first)."""
    import multiprocessing
    import time

    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=_rank_main,
                        args=(fn, r, world_size, str(store_path), backend, pg_timeout_s,
                              args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    assert not hung, f"ranks {hung} of {world_size} did not finish within {timeout_s} s (a hang)"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world_size, f"rank exit codes {codes} (tracebacks above)"


def run_python(code, timeout_s=30):
    """Runs ``code`` in a fresh interpreter that imports the weft this process imported; returns
    the CompletedProcess (text output). A run past timeout_s is killed and fails the test as a
    hang."""
    import subprocess
    import textwrap

    import weft

    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(weft.__file__)))
    env["PYTHONPATH"] = package_parent + os.pathsep + env.get("PYTHONPATH", "")
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: no exit within {timeout_s} s; output so far:\n{e.stdout}\n{e.stderr}")
