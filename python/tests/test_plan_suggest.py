"""weft.plan.suggest: the search on schedules whose best map and lookaheads are known by
construction, determinism, refusals, and the config round trip (suggest -> JSON -> ScheduleConfig
-> the simulation predicts the same step, and the engine gives the same results as the default
map)."""

import json

import pytest

from conftest import drain

import weft
from weft import plan
from weft.pipeline import (Engine, HSTU_TASK_NAMES, Schedule, ScheduleConfig, Task, ThreadMap,
                           hstu_schedule)

pytestmark = pytest.mark.timeout(120)


def heavy_pair(bodies=None):
    """a and b (1000 us of host each, independent, own streams); c (10 us) combines them."""
    bodies = bodies or {}

    def body(name):
        return bodies.get(name, lambda ctx: None)

    return Schedule([
        Task.from_fn("a", body("a"), stream="s1", reads=["batch_cpu"], writes=["x"]),
        Task.from_fn("b", body("b"), stream="s2", reads=["batch_cpu"], writes=["y"]),
        Task.from_fn("c", body("c"), reads=["x", "y"], writes=["step_result"]),
    ])


HEAVY_COSTS = {"tasks": {"a": {"host_us": 1000}, "b": {"host_us": 1000}, "c": {"host_us": 10}}}


def thread_of(suggestion, task):
    return next(p.thread for p in suggestion.placement if p.task == task)


def test_two_independent_host_heavy_tasks_go_on_different_threads():
    r = plan.suggest(heavy_pair(), HEAVY_COSTS, max_threads=3)
    assert r.method == "exact"
    best = r.suggestions[0]
    assert best.step_us == 1010 and r.start.step_us == 2010
    assert best.num_threads == 2  # a third thread brings nothing: fewer threads win the tie
    assert thread_of(best, "a") != thread_of(best, "b")
    assert best.bound == "host"
    assert r.num_evaluated == 5  # Bell(3)


def test_a_wake_up_cost_decides_whether_threads_pay():
    # s feeds a and b (1000 us each), c joins them: on two threads b's thread blocks on s once
    # (1020 us + one wake-up); one thread takes 2020 us, and wins past a 1000 us wake-up.
    fork = Schedule([
        Task.from_fn("s", lambda ctx: None, reads=["batch_cpu"], writes=["z"]),
        Task.from_fn("a", lambda ctx: None, stream="s1", reads=["z"], writes=["x"]),
        Task.from_fn("b", lambda ctx: None, stream="s2", reads=["z"], writes=["y"]),
        Task.from_fn("c", lambda ctx: None, reads=["x", "y"]),
    ])
    costs = {"tasks": {"s": {"host_us": 10}, "a": {"host_us": 1000}, "b": {"host_us": 1000},
                       "c": {"host_us": 10}}}
    r = plan.suggest(fork, costs, max_threads=2, wake_up_us=500)
    assert (r.suggestions[0].step_us, r.suggestions[0].num_threads) == (1520, 2)
    r = plan.suggest(fork, costs, max_threads=2, wake_up_us=2000)
    assert (r.suggestions[0].step_us, r.suggestions[0].num_threads) == (2020, 1)
    with pytest.raises(weft.Error, match="thread_wake_up_us must be in"):
        plan.suggest(fork, costs, wake_up_us=-1)


def test_simulate_takes_the_wake_up_cost_and_the_gil_as_suggest_does():
    # heavy_pair on two threads, a 500 us: a and b overlap (1010 us); with the GIL they run one
    # after the other (1510 us); c, after a on its thread, blocks on b, so its wake-up adds.
    two = ThreadMap.groups({"t0": ["a", "c"], "t1": ["b"]})
    costs = {"tasks": {"a": {"host_us": 500}, "b": {"host_us": 1000}, "c": {"host_us": 10}}}
    step = lambda **kw: plan.simulate(heavy_pair(), two, costs, **kw).timeline.step_us
    assert step() == 1010
    assert step(gil="all") == 1510
    assert step(wake_up_us=100) == 1110
    r = plan.suggest(heavy_pair(), costs, max_threads=2, wake_up_us=100, gil=["a"])
    best = r.suggestions[0]
    schedule = heavy_pair()
    best.config.apply(schedule)
    assert plan.simulate(schedule, best.config.thread_map, costs, wake_up_us=100,
                         gil=["a"]).timeline.step_us == best.step_us
    with pytest.raises(weft.Error, match="thread_wake_up_us must be in"):
        step(wake_up_us=-1)
    with pytest.raises(TypeError, match="simulate: gil is 'all' or a list"):
        step(gil="a")


def test_gil_bodies_gain_nothing_from_threads():
    # Every body holds the GIL: a and b cannot overlap, so one thread (2010 us) ranks first.
    r = plan.suggest(heavy_pair(), HEAVY_COSTS, max_threads=2, gil="all")
    assert (r.suggestions[0].step_us, r.suggestions[0].num_threads) == (2010, 1)
    # Only a holds it: b still overlaps a on its own thread.
    r = plan.suggest(heavy_pair(), HEAVY_COSTS, max_threads=2, gil=["a"])
    assert (r.suggestions[0].step_us, r.suggestions[0].num_threads) == (1010, 2)
    with pytest.raises(weft.Error, match="gil_tasks: the schedule has no task 'ghost'"):
        plan.suggest(heavy_pair(), HEAVY_COSTS, gil=["ghost"])
    with pytest.raises(TypeError, match="gil is 'all' or a list"):
        plan.suggest(heavy_pair(), HEAVY_COSTS, gil="a")


def copy_and_compute():
    """load (memcpy stream) then compute (default stream), 100 us of host and 1000 of GPU each."""
    s = Schedule([
        Task.from_fn("load", lambda ctx: None, stream="memcpy", reads=["batch_cpu"],
                     writes=["batch"]),
        Task.from_fn("compute", lambda ctx: None, reads=["batch"]),
    ])
    costs = {"tasks": {"load": {"host_us": 100, "gpu": [{"stream": "memcpy", "us": 1000}]},
                       "compute": {"host_us": 100, "gpu": [{"stream": "default", "us": 1000}]}}}
    return s, costs


def test_lookahead_that_overlaps_copy_and_compute():
    # The host may run one progress ahead: at equal lookaheads copy and compute of a batch are
    # serial (100 + 100 + 1000 + 1000 us); load one batch ahead hides the copy (1200 us).
    s, costs = copy_and_compute()
    r = plan.suggest(s, costs, max_threads=1, max_lookahead=1, max_host_runahead=1)
    assert [x.step_us for x in r.suggestions] == [1200]  # one map: one suggestion
    assert r.start.step_us == 2100
    assert r.suggestions[0].config.lookahead == {"load": 1, "compute": 0}
    assert r.num_refused == 1  # load at 0, compute at 1: compute would read an unloaded batch


def test_an_overlap_slowdown_makes_the_overlap_pay_less():
    # The same copy and compute with the compute stream at half speed while the copy runs
    # beside it (docs/planner.md, "overlap slowdown"): loading ahead still pays, less.
    s, costs = copy_and_compute()
    slowed = ("default", 2)
    r = plan.suggest(s, costs, max_threads=1, max_lookahead=1, max_host_runahead=1,
                     overlap_slowdown=slowed)
    best = r.suggestions[0]
    assert best.config.lookahead == {"load": 1, "compute": 0}
    assert 1200 < best.step_us < 2100 and r.start.step_us == 2100  # serial: nothing overlaps
    best.config.apply(s)
    assert plan.simulate(s, "legacy", costs, max_host_runahead=1,
                         overlap_slowdown=slowed).timeline.step_us == best.step_us
    assert plan.simulate(s, "legacy", costs, max_host_runahead=1).timeline.step_us == 1200
    with pytest.raises(weft.Error, match="overlap_slowdown must be in"):
        plan.simulate(s, "legacy", costs, overlap_slowdown=("default", 0.5))
    with pytest.raises(TypeError, match=r"overlap_slowdown is \(stream name, factor\)"):
        plan.suggest(s, costs, overlap_slowdown=2)


def test_same_input_gives_byte_identical_output(tmp_path):
    a = plan.suggest("full_split_d6")
    b = plan.suggest("full_split_d6")
    assert a.method == "local" and len(a.suggestions) == 3
    for i, (x, y) in enumerate(zip(a.suggestions, b.suggestions)):
        x.write_config(tmp_path / f"a{i}.json")
        y.write_config(tmp_path / f"b{i}.json")
        assert (tmp_path / f"a{i}.json").read_bytes() == (tmp_path / f"b{i}.json").read_bytes()
    assert str(a) == str(b)
    assert "not searched: streams" in str(a)
    assert a.suggestions[0].step_us <= a.start.step_us


def test_refuses_a_schedule_it_cannot_move_and_bad_arguments():
    one = Schedule([Task.from_fn("only", lambda ctx: None, reads=["batch_cpu"])])
    with pytest.raises(weft.Error, match="cannot move this schedule: it has one task"):
        plan.suggest(one, max_lookahead=0)
    with pytest.raises(weft.Error, match="max_threads is 1 and every lookahead is fixed"):
        plan.suggest(heavy_pair(), HEAVY_COSTS, max_threads=1)
    with pytest.raises(weft.Error, match="max_threads must be in"):
        plan.suggest(heavy_pair(), HEAVY_COSTS, max_threads=0)
    with pytest.raises(TypeError, match="costs or a trace"):
        plan.suggest(heavy_pair(), HEAVY_COSTS, trace="run.trace.json")
    with pytest.raises(weft.Error, match="ghost"):
        plan.suggest(heavy_pair(), {"tasks": {"ghost": {"host_us": 1}}})


def test_config_round_trip_predicts_the_step_and_runs_as_the_default_map(tmp_path):
    def combine(ctx):
        ctx.set("step_result", (ctx.batch_index, ctx.get("x"), ctx.get("y")))

    bodies = {"a": lambda ctx: ctx.set("x", ctx.get("batch_cpu") * 2),
              "b": lambda ctx: ctx.set("y", ctx.get("batch_cpu") + 1),
              "c": combine}
    with Engine(heavy_pair(bodies), "legacy") as engine:
        expected = drain(engine, range(9))
    assert expected == [(i, 2 * i, i + 1) for i in range(9)]

    r = plan.suggest(heavy_pair(), HEAVY_COSTS, max_threads=2, max_lookahead=1, num_best=4)
    assert len(r.suggestions) == 4
    for i, s in enumerate(r.suggestions):
        path = tmp_path / f"suggest-{i}.json"
        s.write_config(path)
        config = ScheduleConfig.load(str(path))
        assert config == s.config
        assert set(json.loads(path.read_text())) == {"thread_map", "lookahead"}
        schedule = heavy_pair(bodies)
        config.apply(schedule)
        predicted = plan.simulate(schedule, config.thread_map, HEAVY_COSTS).timeline
        assert predicted.step_us == s.step_us and predicted.host_step_us == s.host_step_us
        with Engine(schedule, config.thread_map) as engine:
            assert drain(engine, range(9)) == expected, config.to_json()


def test_hstu_suggestion_loads_into_the_hstu_schedule_and_runs():
    s = plan.suggest("full_split_d6").suggestions[0]
    ran = []
    bodies = {name: (lambda ctx, n=name: ran.append((n, ctx.batch_index)))
              for name in HSTU_TASK_NAMES}
    schedule = hstu_schedule(bodies, cascade="d3")
    s.config.apply(schedule)
    assert {t.name: t.lookahead for t in schedule.tasks} == s.config.lookahead
    predicted = plan.simulate(schedule, s.config.thread_map).timeline
    assert predicted.step_us == s.step_us
    with Engine(schedule, s.config.thread_map) as engine:
        assert len(drain(engine, range(6))) == 6
    # Every task ran on every batch exactly once, as under the default map.
    assert sorted(ran) == sorted((n, b) for n in HSTU_TASK_NAMES for b in range(6))


def test_costs_from_a_real_runs_trace(tmp_path):
    with Engine(heavy_pair(), ThreadMap.legacy(), trace=True) as engine:
        drain(engine, range(12))
        trace = engine.take_trace()
    trace_path = tmp_path / "run.trace.json"
    trace.write_chrome_json(str(trace_path))
    r = plan.suggest(heavy_pair(), trace=trace_path, max_threads=2)
    # The costs are what weft.plan.trace_costs measures of the same trace (the file read back
    # whole, every run): the legacy map, simulated with them, runs its tasks one after another.
    costs = plan.trace_costs(trace, heavy_pair())
    assert r.start.host_step_us == pytest.approx(
        sum(task["host_us"] for task in costs["tasks"].values()))
    assert r.suggestions[0].step_us <= r.start.step_us
    # gpu_waits go to the trace's costs: a host-backend trace has no GPU work, so c's wait for
    # a's ends at once and the figures stay; c before a on a thread would be refused.
    waited = plan.suggest(heavy_pair(), trace=trace_path, max_threads=2, gpu_waits={"c": "a"})
    assert waited.start.step_us == r.start.step_us
    assert waited.suggestions[0].step_us == r.suggestions[0].step_us
    with pytest.raises(TypeError, match="gpu_waits is for the costs a trace measures"):
        plan.suggest(heavy_pair(), costs=costs, gpu_waits={"c": "a"})
    with pytest.raises(TypeError, match="gpu_waits maps task names"):
        plan.suggest(heavy_pair(), trace=trace_path, gpu_waits={"c": 1})
    with pytest.raises(TypeError, match="gpu_waits maps task names"):
        plan.suggest(heavy_pair(), trace=trace_path, gpu_waits="c=a")
    # No waits is no waits, with a cost model too.
    assert plan.suggest(heavy_pair(), costs=costs, max_threads=2,
                        gpu_waits={}).start.step_us == pytest.approx(r.start.step_us)