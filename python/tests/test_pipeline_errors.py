"""weft.pipeline's error contract from Python: the body's own exception (type, object,
traceback) reaches the caller of progress(), the other threads wake, and Ctrl-C does not hang."""

import os
import signal
import threading
import time
import traceback

import pytest

import weft
from weft.pipeline import Engine, Schedule, Task, hstu_schedule

pytestmark = pytest.mark.timeout(60)

MAPS = ["legacy", "per_task", "by_stream", "default"]


class BodyError(Exception):
    pass


def failing_schedule(fail_at_batch, started):
    def producer(ctx):
        if ctx.get("batch_cpu") == fail_at_batch:
            raise BodyError(f"batch {fail_at_batch}")
        ctx.set("x", ctx.get("batch_cpu"))

    def consumer(ctx):
        started.append(ctx.get("x"))
        ctx.set("step_result", ctx.get("x"))

    return Schedule([
        Task.from_fn("producer", producer, reads=["batch_cpu"], writes=["x"], stream="a"),
        Task.from_fn("consumer", consumer, reads=["x"], writes=["step_result"]),
    ])


@pytest.mark.parametrize("thread_map", MAPS)
def test_the_bodys_exception_reaches_the_caller_unchanged(thread_map):
    started = []
    engine = Engine(failing_schedule(2, started), thread_map)
    it = iter(range(5))
    assert [engine.progress(it), engine.progress(it)] == [0, 1]
    with pytest.raises(BodyError) as info:
        engine.progress(it)
    assert str(info.value) == "batch 2"
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "producer" in frames  # the body's own frame, where it raised
    assert started == [0, 1]     # the consumer, waiting on another thread, woke and was skipped
    assert engine.failed
    with pytest.raises(weft.Error, match="failed in an earlier progress.*BodyError: batch 2"):
        engine.progress(it)
    engine.reset()
    assert not engine.failed
    assert engine.progress(it) == 3  # item 2 was discarded with the failed step


def test_the_same_exception_object_arrives():
    raised = []

    def body(ctx):
        e = KeyError("the key")
        raised.append(e)
        raise e

    engine = Engine(Schedule([Task.from_fn("t", body, reads=["batch_cpu"])]), "per_task")
    with pytest.raises(KeyError) as info:
        engine.progress(iter([0]))
    assert info.value is raised[0]


def test_an_error_in_hstu_wakes_every_thread():
    def backward(ctx):
        raise ValueError("backward")

    for variant_map in ["default", "per_task", "full_split"]:
        engine = Engine(hstu_schedule({"backward": backward}), variant_map)
        with pytest.raises(ValueError, match="backward"):
            engine.progress(iter(range(10)))


def test_an_init_error_fails_the_constructor():
    def init(ctx):
        raise OSError("no device")

    with pytest.raises(OSError, match="no device"):
        Engine(Schedule([Task.from_fn("t", None, init=init)]), "per_task")


def test_stop_iteration_in_a_body_does_not_look_like_the_end_of_data():
    def body(ctx):
        next(iter([]))

    engine = Engine(Schedule([Task.from_fn("t", body, reads=["batch_cpu"])]), "per_task")
    with pytest.raises(RuntimeError, match="task 't' raised StopIteration") as info:
        engine.progress(iter([0]))
    assert isinstance(info.value.__cause__, StopIteration)


def test_an_error_of_the_data_iterator_reaches_the_caller():
    def data():
        yield 0
        raise ZeroDivisionError("loader")

    engine = Engine(Schedule([Task.from_fn("t", None, reads=["batch_cpu"])]), "per_task")
    it = data()
    engine.progress(it)
    with pytest.raises(ZeroDivisionError, match="loader"):
        engine.progress(it)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_ctrl_c_while_progress_waits_raises_keyboard_interrupt():
    release = threading.Event()

    def slow(ctx):
        release.wait(timeout=5)  # a body blocked without the GIL

    def later(ctx):
        raise AssertionError("skipped after the interrupt")

    s = Schedule([Task.from_fn("slow", slow, reads=["batch_cpu"], writes=["x"]),
                  Task.from_fn("later", later, reads=["x"], stream="b")])
    engine = Engine(s, "per_task")

    def on_sigint(signum, frame):
        # Runs where the engine checks for interrupts: the body is let go only once the engine
        # has seen the interrupt (and 0.1 s later, by which it has failed the step), so that
        # `later` is skipped however slowly a loaded machine schedules the threads.
        threading.Timer(0.1, release.set).start()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            engine.progress(iter(range(3)))
    finally:
        signal.signal(signal.SIGINT, previous)
    # Raised once the running body returned (about 0.3 s), long before its 5 s timeout.
    assert time.monotonic() - start < 3
    assert engine.failed
    engine.reset()
    release.set()
    s2 = Schedule([Task.from_fn("t", lambda c: c.set("step_result", c.get("batch_cpu")),
                                reads=["batch_cpu"], writes=["step_result"])])
    assert Engine(s2, "per_task").progress(iter([7])) == 7
