"""The GIL: engine threads hold it only while running a body, progress() releases it while it
waits, so bodies that block let the other threads (engine or not) run."""

import threading
import time

import pytest

from weft.pipeline import Engine, Schedule, Task

pytestmark = pytest.mark.timeout(60)


def test_bodies_that_sleep_run_in_parallel():
    def sleepy(ctx):
        time.sleep(0.3)

    s = Schedule([Task.from_fn(f"t{i}", sleepy, stream=f"s{i}", reads=["batch_cpu"])
                  for i in range(4)])
    engine = Engine(s, "per_task")
    start = time.monotonic()
    engine.progress(iter([0]))
    # Four 0.3 s sleeps on four threads: about 0.3 s, not 1.2 s.
    assert time.monotonic() - start < 0.9


def test_a_body_waiting_for_another_threads_body_does_not_deadlock():
    # No edge between them: only running both at once lets the step finish.
    ready = threading.Event()

    def waiter(ctx):
        assert ready.wait(timeout=10), "setter never ran"

    def setter(ctx):
        time.sleep(0.05)
        ready.set()

    for order in [(waiter, setter), (setter, waiter)]:
        ready.clear()
        s = Schedule([Task.from_fn(f"t{i}", fn, stream=f"s{i}", reads=["batch_cpu"])
                      for i, fn in enumerate(order)])
        engine = Engine(s, "per_task")
        engine.progress(iter([0]))


def test_python_threads_run_while_progress_waits():
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    def slow(ctx):
        time.sleep(0.3)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        engine = Engine(Schedule([Task.from_fn("slow", slow, reads=["batch_cpu"])]), "per_task")
        before = count[0]
        engine.progress(iter([0]))
        assert count[0] - before > 1000  # the spinning thread ran during the step
    finally:
        stop.set()
        thread.join()


def test_thread_locals_persist_on_an_engine_thread():
    local = threading.local()
    seen = []

    def body(ctx):
        seen.append(getattr(local, "n", 0))
        local.n = getattr(local, "n", 0) + 1

    engine = Engine(Schedule([Task.from_fn("t", body, reads=["batch_cpu"])]), "per_task")
    it = iter(range(5))
    for _ in range(5):
        engine.progress(it)
    assert seen == [0, 1, 2, 3, 4]


def test_engines_come_and_go_without_leaking_threads():
    before = threading.active_count()
    for _ in range(50):
        engine = Engine(Schedule([Task.from_fn("t", lambda c: None, reads=["batch_cpu"]),
                                  Task.from_fn("u", lambda c: None, stream="x")]), "per_task")
        engine.progress(iter([0]))
        engine.close()
    assert threading.active_count() == before
