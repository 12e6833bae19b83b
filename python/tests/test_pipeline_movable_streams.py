"""Tasks free to move between streams (Task(movable_to=...)): the schedule carries the
declaration to C++, a ScheduleConfig's "stream" entry moves only such a task and only onto a
stream it may run on (checked by the C++ rule, nothing changed when refused), weft.plan.suggest
finds the move where it is better by construction, and the engine runs the moved schedule with
the results of the schedule as given."""

import re

import pytest

from conftest import drain

import weft
from weft import plan
from weft.pipeline import Engine, Schedule, ScheduleConfig, Task

pytestmark = pytest.mark.timeout(120)

# a and b are independent, 100 us of GPU work each on s1; b may also run on s2. On one stream a
# step takes 200 us of GPU time; with b on s2 the two overlap: 100 us, which no thread map or
# lookahead reaches otherwise.
COSTS = {"default_host_us": 1, "tasks": {
    "a": {"host_us": 1, "gpu": [{"stream": "s1", "us": 100}]},
    "b": {"host_us": 1, "gpu": [{"stream": "s1", "us": 100}]}}}


def two_gpu_tasks():
    def a(ctx):
        ctx.set("x", ctx.get("batch_cpu") + 1)

    def b(ctx):
        ctx.set("y", ctx.get("batch_cpu") * 3)

    def c(ctx):
        ctx.set("step_result", (ctx.get("x"), ctx.get("y")))

    return Schedule([
        Task.from_fn("a", a, stream="s1", reads=["batch_cpu"], writes=["x"]),
        Task.from_fn("b", b, stream="s1", movable_to=["s2"], reads=["batch_cpu"], writes=["y"]),
        Task.from_fn("c", c, reads=["x", "y"], writes=["step_result"]),
    ], streams=["s1", "s2"])


def test_a_config_moves_a_movable_task_and_the_engine_gives_the_same_results():
    want = drain(Engine(two_gpu_tasks(), "per_task"), range(10))
    s = two_gpu_tasks()
    config = ScheduleConfig.from_dict({"stream": {"b": "s2"}, "lookahead": {"a": 1}})
    assert config.stream == {"b": "s2"}
    config.apply(s)
    # The stream it left stays one it may run on.
    assert (s.task("b").stream, s.task("b").movable_to) == ("s2", ("s1",))
    assert s.task("a").lookahead == 1
    assert ScheduleConfig.parse(config.to_json()) == config
    for thread_map in ("per_task", "legacy"):
        assert drain(Engine(s, thread_map), range(10)) == want
    # Moved back: the declaration is unchanged by the round trip.
    ScheduleConfig.from_dict({"stream": {"b": "s1"}}).apply(s)
    assert (s.task("b").stream, s.task("b").movable_to) == ("s1", ("s2",))


@pytest.mark.parametrize("entry, fragments", [
    ({"a": "s2"}, [r"\$\.stream\.a", "task 'a' cannot move to stream 's2'", "fixed"]),
    ({"b": "default"}, [r"\$\.stream\.b", "movable_to allows 's1', 's2' only"]),
    ({"ghost": "s2"}, [r"\$\.stream\.ghost", "no task 'ghost'"]),
])
def test_a_move_the_schedule_does_not_allow_is_refused_and_changes_nothing(entry, fragments):
    s = two_gpu_tasks()
    config = ScheduleConfig.from_dict({"lookahead": {"b": 2}, "stream": entry})
    with pytest.raises(weft.Error) as info:
        config.apply(s)
    for fragment in fragments:
        assert re.search(fragment, str(info.value)), str(info.value)
    assert [(t.name, t.stream, t.lookahead) for t in s.tasks] == \
        [("a", "s1", 0), ("b", "s1", 0), ("c", "default", 0)]


def test_a_movable_to_stream_the_schedule_lacks_is_refused():
    s = Schedule([Task.from_fn("a", None, stream="s1", movable_to=["nowhere"],
                               writes=["step_result"])], streams=["s1"])
    with pytest.raises(weft.Error,
                       match="task 'a' is movable to stream 'nowhere' which is not declared"):
        Engine(s, "legacy")


def test_suggest_moves_the_movable_task_to_the_free_stream():
    results = [plan.suggest(two_gpu_tasks(), COSTS, max_threads=2, max_lookahead=0)
               for _ in range(2)]
    best = results[0].suggestions[0]
    assert results[0].start.step_us == pytest.approx(200)
    assert best.step_us == pytest.approx(100)
    assert best.config.stream == {"b": "s2"}
    assert [s.config for s in results[0].suggestions] == \
        [s.config for s in results[1].suggestions]  # deterministic
    for suggestion in results[0].suggestions:
        assert "a" not in suggestion.config.stream  # never moves the task that is not movable
    # The suggestion as a config: applied and run, it gives the schedule's own results.
    s = two_gpu_tasks()
    best.config.apply(s)
    assert s.task("b").stream == "s2"
    assert drain(Engine(s, best.config.thread_map or "legacy"), range(6)) == \
        drain(Engine(two_gpu_tasks(), "legacy"), range(6))
