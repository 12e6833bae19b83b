"""Collectives issued through torch.distributed from bodies on different engine threads keep one
order across ranks (the engine's tickets): 2 and 3 processes over gloo, hundreds of steps under
threaded maps, every body sleeping a random while first (seeded per rank, so the threads race
differently on each rank), every element of every result checked. A collective paired with
another task's on some rank gives wrong values or sizes, or no partner (the group's timeout)."""

import random
import time

import pytest

torch = pytest.importorskip("torch")

from conftest import drain, run_ranks  # noqa: E402

NUM_STEPS = 200
MAX_JITTER_S = 0.0005

# (name, stream, lookahead, collective, number of elements): every collective task differs in
# kind or size from the others, so a wrong pairing cannot go unnoticed.
TASKS = [
    ("h2d", "memcpy", 2, None, 0),
    ("start_shuffle", "memcpy", 2, "all_gather", 3),
    ("finish_shuffle", "memcpy", 1, "all_reduce", 5),
    ("start_input_dist", "data_dist", 1, "all_to_all", 2),
    ("wait_input_dist", "data_dist", 1, "all_reduce", 7),
    ("prefetch_embeddings", "prefetch", 1, "all_gather", 4),
    ("forward", "default", 0, "all_reduce", 11),
    ("backward", "default", 0, "all_to_all", 3),
    ("optimizer_step", "default", 0, "all_gather", 6),
]
CUSTOM_MAP = {"a": ["h2d", "forward", "wait_input_dist"],
              "b": ["start_shuffle", "backward", "prefetch_embeddings"],
              "c": ["finish_shuffle", "start_input_dist", "optimizer_step"]}


def collective_body(name, op, n, code, rank, world, rng):
    """A body that issues ``op`` on n elements whose values name (task, batch, rank) and checks
    every element it gets back."""
    import torch.distributed as dist

    def body(ctx):
        time.sleep(rng.random() * MAX_JITTER_S)
        batch = ctx.get("batch")
        tag = code * 1000 + batch
        if op == "all_reduce":
            t = torch.arange(n, dtype=torch.int64) + (rank + 1) * tag
            dist.all_reduce(t)
            expect = world * torch.arange(n, dtype=torch.int64) + tag * world * (world + 1) // 2
        elif op == "all_gather":
            out = torch.empty(world * n, dtype=torch.int64)
            dist.all_gather_into_tensor(out, torch.arange(n, dtype=torch.int64) + rank * 10**7
                                        + tag * 10)
            t = out.view(world, n)
            expect = (torch.arange(n, dtype=torch.int64)[None, :] + tag * 10
                      + torch.arange(world, dtype=torch.int64)[:, None] * 10**7)
        else:  # all_to_all: n + d elements to rank d, each naming (source, destination, tag)
            send = torch.cat([torch.full((n + d,), rank * 10**8 + d * 10**7 + tag)
                              for d in range(world)])
            t = torch.empty(world * (n + rank), dtype=torch.int64)
            dist.all_to_all_single(t, send, [n + rank] * world, [n + d for d in range(world)])
            expect = torch.cat([torch.full((n + rank,), s * 10**8 + rank * 10**7 + tag)
                                for s in range(world)])
        if not torch.equal(t, expect):
            raise AssertionError(f"rank {rank} task {name} batch {batch}: got {t.tolist()}, "
                                 f"expected {expect.tolist()}")
        if name == "optimizer_step":
            ctx.set("step_result", batch)

    return body


def make_schedule(rank, world, collective=True):
    from weft.pipeline import Schedule, Task

    def h2d(ctx):
        time.sleep(rngs["h2d"].random() * MAX_JITTER_S)
        ctx.set("batch", ctx.get("batch_cpu"))

    rngs = {name: random.Random(f"{rank}/{name}") for name, *_ in TASKS}
    tasks = []
    for code, (name, stream, la, op, n) in enumerate(TASKS):
        if op is None:
            tasks.append(Task.from_fn(name, h2d, stream=stream, lookahead=la,
                                      reads=["batch_cpu"], writes=["batch"]))
            continue
        writes = ["step_result"] if name == "optimizer_step" else []
        tasks.append(Task.from_fn(name, collective_body(name, op, n, code, rank, world,
                                                        rngs[name]),
                                  stream=stream, lookahead=la, reads=["batch"], writes=writes,
                                  collective=collective))
    return Schedule(tasks)


def run_maps(rank, world, collective=True):
    from weft.pipeline import Engine

    for thread_map in ["per_task", "full_split", CUSTOM_MAP]:
        with Engine(make_schedule(rank, world, collective), thread_map) as engine:
            got = drain(engine, range(NUM_STEPS))
        assert got == list(range(NUM_STEPS)), f"rank {rank} {thread_map}: results {got[:10]}..."


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_keep_one_order_across_ranks(tmp_path, world_size):
    run_ranks(run_maps, world_size, tmp_path / "store", timeout_s=120, pg_timeout_s=20)
