"""weft.pipeline on a GPU (backend "torch"): torch streams current in the bodies, events that
order with the engine's, the caller's torch state on the engine threads, and slot lifetime
against the caching allocator. Skipped without a GPU."""

import pytest

from conftest import drain, needs_gpus
from weft.pipeline import Engine, Schedule, Task

pytestmark = [needs_gpus(1), pytest.mark.timeout(300)]


def test_the_tasks_stream_is_current_in_its_body():
    import torch

    seen = {}

    def body(ctx):
        seen[ctx.name] = (torch.cuda.current_stream().cuda_stream, ctx.stream_handle(),
                          torch.is_grad_enabled())

    s = Schedule([Task.from_fn("a", body, stream="memcpy", reads=["batch_cpu"]),
                  Task.from_fn("b", body)])
    with torch.no_grad():
        engine = Engine(s, "per_task", backend="torch")
    drain(engine, [0])
    assert seen["a"][0] == seen["a"][1] == engine.stream_handle("memcpy")
    assert seen["b"][0] == seen["b"][1] == engine.stream_handle("default")
    assert seen["a"][0] != seen["b"][0]
    assert not seen["a"][2] and not seen["b"][2]  # the caller's no_grad holds on engine threads


def test_the_callers_state_is_put_back_after_bodies_on_its_own_thread():
    # The sequential executor runs the bodies on the caller's thread. Neither what the wrapper
    # sets for a task (its stream) nor what a body changes itself (grad mode, the current stream,
    # autocast) may outlive the body there or reach the next task's body; nor after a body
    # raises. The Engine and the caller both have grad off, so only a body turns it on.
    import torch

    seen = []
    other = torch.cuda.Stream()
    fail = [False]

    def first(ctx):
        seen.append(("first", torch.is_grad_enabled(), torch.cuda.current_stream().cuda_stream))
        torch.set_grad_enabled(True)
        torch.cuda.set_stream(other)
        torch.set_autocast_enabled("cuda", True)
        if fail[0]:
            raise ValueError("a body's error")

    def second(ctx):
        seen.append(("second", torch.is_grad_enabled(), torch.cuda.current_stream().cuda_stream,
                     torch.is_autocast_enabled("cuda")))

    def engine():
        return Engine(Schedule([Task.from_fn("a", first, stream="side", reads=["batch_cpu"]),
                                Task.from_fn("b", second)]), "legacy", backend="torch")

    mine = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(mine):
        e = engine()
        drain(e, [0, 1])
        assert torch.cuda.current_stream() == mine
        assert not torch.is_grad_enabled() and not torch.is_autocast_enabled("cuda")
    side, default = e.stream_handle("side"), e.stream_handle("default")
    assert seen == [("first", False, side), ("second", False, default, False)] * 2
    e.close()
    fail[0] = True
    with torch.no_grad(), torch.cuda.stream(mine):
        e = engine()
        with pytest.raises(ValueError, match="a body's error"):
            drain(e, [0])
        assert torch.cuda.current_stream() == mine
        assert not torch.is_grad_enabled() and not torch.is_autocast_enabled("cuda")
    e.close()


@pytest.mark.parametrize("thread_map", ["legacy", "per_task"])
def test_the_engines_autocast_holds_in_the_bodies_and_the_callers_is_left_as_found(thread_map):
    # Bodies see the autocast state of the Engine's builder, whatever the caller of progress()
    # has on (on "legacy" the bodies run on that caller's thread), and the caller keeps its own.
    import torch

    seen = []

    def body(ctx):
        a = torch.ones(8, 8, device="cuda")
        seen.append((torch.is_autocast_enabled("cuda"), (a @ a).dtype))

    def engine():
        return Engine(Schedule([Task.from_fn("t", body, reads=["batch_cpu"])]), thread_map,
                      backend="torch")

    with torch.autocast("cuda", dtype=torch.bfloat16):
        on = engine()
    off = engine()
    drain(on, [0])
    assert not torch.is_autocast_enabled("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        drain(off, [0])
        drain(on, [0])
        assert torch.is_autocast_enabled("cuda")
        assert (torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")).dtype == \
            torch.float16
    assert seen == [(True, torch.bfloat16), (False, torch.float32), (True, torch.bfloat16)]
    on.close()
    off.close()


@pytest.mark.parametrize("thread_map", ["legacy", "per_task", "by_stream"])
def test_a_tensor_read_on_another_stream_outlives_its_slot(thread_map):
    # The producer's tensor is read on another stream behind a long sleep kernel; meanwhile the
    # next batches allocate and overwrite tensors of the same size on the producer's stream. If
    # a slot's value were freed before its reader's GPU work completed, the allocator would hand
    # its block to one of them and the reader would sum the wrong values.
    import torch

    n = 1 << 20

    def produce(ctx):
        ctx.set("x", torch.full((n,), float(ctx.get("batch_cpu")), device="cuda"))

    def consume(ctx):
        torch.cuda._sleep(20_000_000)  # tens of ms of GPU time before the read
        ctx.set("step_result", ctx.get("x").sum())

    def scribble(ctx):
        garbage = torch.empty((n,), device="cuda")
        garbage.fill_(-1.0)

    s = Schedule([
        Task.from_fn("produce", produce, stream="a", lookahead=1, reads=["batch_cpu"],
                     writes=["x"]),
        Task.from_fn("scribble", scribble, stream="a", lookahead=1, depends_on=["produce"]),
        Task.from_fn("consume", consume, reads=["x"], writes=["step_result"]),
    ])
    engine = Engine(s, thread_map, backend="torch")
    results = drain(engine, range(12))
    engine.synchronize()
    assert [r.item() for r in results] == [float(i * n) for i in range(12)]


def test_torch_events_order_with_the_engines():
    import torch

    def produce(ctx):
        ctx.set("x", torch.arange(1 << 16, device="cuda", dtype=torch.float32))
        event = torch.cuda.Event()
        event.record()
        ctx.set("event", event)

    def consume(ctx):
        ctx.get("event").wait()
        ctx.set("step_result", ctx.get("x").sum())

    s = Schedule([
        Task.from_fn("produce", produce, stream="side", reads=["batch_cpu"],
                     writes=["x", "event"]),
        Task.from_fn("consume", consume, reads=["x", "event"], writes=["step_result"]),
    ])
    engine = Engine(s, "per_task", backend="torch")
    results = drain(engine, range(3))
    engine.synchronize()  # made on the engine's streams, read on the caller's
    assert all(r.item() == float(sum(range(1 << 16))) for r in results)


def test_the_engine_adopts_the_callers_torch_streams():
    import torch

    mine = torch.cuda.Stream()
    seen = []

    def body(ctx):
        seen.append(torch.cuda.current_stream() == mine)
        ctx.set("step_result", torch.ones(4, device="cuda").sum())

    s = Schedule([Task.from_fn("t", body, stream="mine", reads=["batch_cpu"],
                               writes=["step_result"])])
    engine = Engine(s, "per_task", backend="torch", streams={"mine": mine})
    assert engine.stream_handle("mine") == mine.cuda_stream
    results = drain(engine, range(3))
    engine.synchronize()  # made on "mine", read on the caller's current stream
    assert [r.item() for r in results] == [4.0] * 3
    assert seen == [True] * 3
    engine.close()
    mine.synchronize()  # still a valid stream after the engine is gone
