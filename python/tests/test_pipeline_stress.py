"""weft.pipeline at length: thousands of steps of the HSTU schedule with Python bodies under every
preset map, and random schedules whose results under every threaded map equal the sequential
executor's."""

import random
import threading

import pytest

from conftest import drain

from weft.pipeline import (HSTU_TASK_NAMES, Engine, Schedule, Task, ThreadMap, hstu_schedule,
                           hstu_variants)

pytestmark = pytest.mark.timeout(300)


def hstu_bodies(log):
    """Bodies that pass each batch's value along the HSTU slots and check what they read."""
    lock = threading.Lock()

    def note(ctx):
        with lock:
            log[ctx.name] = log.get(ctx.name, 0) + 1

    def h2d(ctx):
        note(ctx)
        v = ctx.get("batch_cpu")
        ctx.set("batch_gpu", v)
        ctx.set("ctx", ("ctx", v))

    def start_shuffle(ctx):
        note(ctx)
        ctx.set("shuffle_handle", ctx.get("batch_gpu") + 1)

    def finish_shuffle(ctx):
        note(ctx)
        assert ctx.get("shuffle_handle") == ctx.get("batch_gpu") + 1
        ctx.set("shuffled_batch", ctx.get("batch_gpu") * 10)

    def start_input_dist(ctx):
        note(ctx)
        assert ctx.get("ctx") == ("ctx", ctx.get("shuffled_batch") // 10)
        ctx.set("dist_request", ctx.get("shuffled_batch"))

    def global_tokens(ctx):
        note(ctx)
        ctx.set("global_tokens", ctx.get("batch_gpu"))

    def output_dist(ctx):
        note(ctx)
        ctx.set("embeddings", ctx.batch_index)

    def forward(ctx):
        note(ctx)
        ctx.set("losses", ctx.get("embeddings"))
        ctx.set("output", None)

    def backward(ctx):
        note(ctx)
        assert ctx.get("losses") == ctx.batch_index

    def optimizer_step(ctx):
        note(ctx)
        ctx.set("step_result", ctx.batch_index)

    bodies = {name: note for name in HSTU_TASK_NAMES}
    bodies.update(h2d=h2d, start_shuffle=start_shuffle, finish_shuffle=finish_shuffle,
                  start_input_dist=start_input_dist, global_tokens_allreduce=global_tokens,
                  compute_output_dist=output_dist, forward=forward, backward=backward,
                  optimizer_step=optimizer_step)
    return bodies


@pytest.mark.parametrize("variant", [v.name for v in hstu_variants()] + ["by_stream_d6",
                                                                        "per_task_d6"])
def test_thousands_of_hstu_steps_under_every_map(variant):
    cascade = variant.rsplit("_", 1)[1]
    thread_map = {v.name: v.thread_map for v in hstu_variants()}.get(variant,
                                                                    variant.rsplit("_", 1)[0])
    if cascade == "none":
        cascade = "d3"
    log = {}
    num_steps = 2000
    engine = Engine(hstu_schedule(hstu_bodies(log), cascade=cascade), thread_map)
    assert drain(engine, range(num_steps)) == list(range(num_steps))
    assert log == {name: num_steps for name in HSTU_TASK_NAMES}


def random_schedule(rng):
    """A random valid schedule: tasks in declaration order, each reading slots of earlier tasks
    whose lookahead is at least its own, on random streams, with a few depends_on and
    cross_iter edges; every body writes a value computed from what it read."""
    num_tasks = rng.randint(2, 9)
    streams = [f"s{i}" for i in range(rng.randint(1, 4))]
    tasks = []
    for i in range(num_tasks):
        la = rng.randint(0, 3)
        earlier = [t for t in tasks if t["la"] >= la]
        reads = rng.sample(earlier, k=min(len(earlier), rng.randint(0, 2)))
        others = [t for t in tasks if t["la"] >= la and t not in reads]
        depends = rng.sample(others, k=min(len(others), rng.randint(0, 1)))
        # cross_iter: a producer (of any la) at offset -1 .. -2, kept within the ring.
        rest = [t for t in tasks if t not in reads and t not in depends]
        cross = []
        if rest and rng.random() < 0.4:
            p = rng.choice(rest)
            offset = -rng.randint(1, 2)
            if 0 <= p["la"] - la - offset <= 3:  # no edge into the future; within the ring
                cross = [(p, offset)]
        tasks.append({"name": f"t{i}", "la": la, "stream": rng.choice(streams),
                      "reads": reads, "depends": depends, "cross": cross})
    return tasks


def build(tasks, sink):
    def body_for(t):
        name = t["name"]
        reads = [f"v_{r['name']}" for r in t["reads"]]

        def body(ctx):
            value = hash((name, ctx.get("batch_cpu"), tuple(ctx.get(s) for s in reads))) % 1000003
            ctx.set(f"v_{name}", value)
            sink.append((name, ctx.batch_index, value))
        return body

    out = []
    for t in tasks:
        out.append(Task.from_fn(
            t["name"], body_for(t), stream=t["stream"], lookahead=t["la"],
            reads=["batch_cpu"] + [f"v_{r['name']}" for r in t["reads"]],
            writes=[f"v_{t['name']}"], depends_on=[d["name"] for d in t["depends"]],
            cross_iter_depends_on=[(p["name"], o) for p, o in t["cross"]]))
    # The step's result: every value of the batch, read by a la = 0 task.
    names = [f"v_{t['name']}" for t in tasks]

    def collect(ctx):
        ctx.set("step_result", tuple(ctx.get(n) for n in names))

    out.append(Task.from_fn("collect", collect, reads=names, writes=["step_result"]))
    return Schedule(out)


@pytest.mark.parametrize("seed", range(40))
def test_random_schedules_match_the_sequential_executor(seed):
    rng = random.Random(seed)
    tasks = random_schedule(rng)
    num_batches = rng.randint(1, 40)
    expected_log = []
    expected = drain(Engine(build(tasks, expected_log), "legacy"), range(num_batches))
    assert len(expected) == num_batches
    for thread_map in ["per_task", "by_stream", "default",
                       ThreadMap.groups({"a": [t["name"] for t in tasks[::2]]}, rest="b")]:
        log = []
        got = drain(Engine(build(tasks, log), thread_map), range(num_batches))
        assert got == expected, (seed, thread_map)
        assert sorted(log) == sorted(expected_log), (seed, thread_map)
