"""weft.plan: the planner from Python. The simulator's statements about the HSTU presets (those
the C++ tests make), a schedule timed by hand, the HTML report, a real engine run's trace drawn
into it, and bad input."""

import json
import os
import time

import pytest

from conftest import drain

import weft
from weft import plan
from weft.pipeline import Engine, HSTU_TASK_NAMES, Schedule, Task, hstu_schedule, hstu_variants

pytestmark = pytest.mark.timeout(120)

VARIANT_NAMES = [v.name for v in hstu_variants()]
IO_TASKS = {"h2d", "start_shuffle", "finish_shuffle"}


def lookahead_rule(rule):
    """Waits of the schedule's lookahead rules (tickets and stream order are the engine's own)."""
    return rule not in ("ticket", "stream_order")


def test_no_d3_variant_waits_from_io_to_non_io_but_default_and_full_split_d6_do():
    assert len(VARIANT_NAMES) == 9
    for v in hstu_variants():
        waits = plan.simulate(v.name).timeline.waits
        io_to_non_io = [w for w in waits if lookahead_rule(w.rule) and w.producer in IO_TASKS
                        and w.consumer not in IO_TASKS]
        if v.cascade == "d3":
            assert io_to_non_io == [], v.name
        elif v.name in ("default_d6", "full_split_d6"):
            shuffle = [w for w in io_to_non_io
                       if (w.producer, w.consumer) == ("finish_shuffle", "start_input_dist")]
            assert len(shuffle) == 1, v.name
            assert shuffle[0].rule == "same_lookahead"
            assert "slot shuffled_batch" in shuffle[0].cause
            assert "la 3 == 3" in shuffle[0].cause


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_every_task_runs_once_and_threads_never_overlap(name):
    v = plan.simulate(name)
    t = v.timeline
    assert v.name == name and v.source == "simulated"
    assert sorted(s.task for s in t.host) == sorted(HSTU_TASK_NAMES)
    for a in t.host:
        for b in t.host:
            if a is not b and a.thread == b.thread:
                assert a.end_us <= b.start_us or b.end_us <= a.start_us, (a.task, b.task)
    assert t.step_us > 0
    assert t.host_step_us > 0
    assert [p.task for p in v.placement] == hstu_schedule(cascade=v.cascade).run_order()


def test_thread_maps_are_described_as_the_report_draws_them():
    assert plan.simulate("full_split_d6").thread_map == "io / data_dist / prefetch / compute (4)"
    assert plan.simulate("legacy_none").thread_map == "- (legacy, one thread)"
    assert plan.simulate("per_task_d3").thread_map == f"per_task ({len(HSTU_TASK_NAMES)})"
    assert plan.simulate(two_threads(), "by_stream").thread_map == "by_stream (2)"


def test_legacy_never_waits_and_per_task_backward_waits_for_forward():
    legacy = plan.simulate("legacy_none").timeline
    assert legacy.waits == [] and len(legacy.threads) == 1
    per_task = plan.simulate("per_task_d3").timeline
    assert any(w.producer == "forward" and w.consumer == "backward"
               and w.rule == "same_lookahead" for w in per_task.waits)
    span = {s.task: s for s in per_task.host}
    assert span["backward"].start_us >= span["forward"].end_us


def two_threads():
    return Schedule([Task("A", stream="s1", writes=["x"]), Task("B", stream="s2", reads=["x"])],
                    streams=["s1", "s2"], inputs=[])


TWO_THREAD_COSTS = {"tasks": {"A": {"host_us": 10, "gpu": [{"stream": "s1", "us": 100}]},
                              "B": {"host_us": 5, "gpu": [{"stream": "s2", "us": 50}]}}}


def test_hand_computed_two_thread_schedule():
    # host: A [0,10] on t0, B [10,15] on t1 (waits 10 us for A); GPU: s1-bound, 100 us a step.
    v = plan.simulate(two_threads(), {"t0": ["A"], "t1": ["B"]}, TWO_THREAD_COSTS, name="two")
    t = v.timeline
    assert v.name == "two" and v.cascade == "custom"
    assert t.step_us == 100 and t.host_step_us == 15
    assert [(s.task, s.thread, s.start_us, s.end_us) for s in t.host] == [
        ("A", "t0", 0, 10), ("B", "t1", 10, 15)]
    assert [(w.producer, w.consumer, w.rule, w.waited_us) for w in t.waits] == [
        ("A", "B", "same_lookahead", 10)]
    assert {(g.task, g.stream) for g in t.gpu} >= {("A", "s1"), ("B", "s2")}
    assert [(p.task, p.thread, p.stream) for p in v.placement] == [("A", "t0", "s1"),
                                                                  ("B", "t1", "s2")]


def test_costs_as_dict_file_or_cost_model_agree(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(TWO_THREAD_COSTS))
    model = plan.CostModel.parse(json.dumps(TWO_THREAD_COSTS))
    steps = {plan.simulate(two_threads(), "per_task", c).timeline.step_us
             for c in (TWO_THREAD_COSTS, path, str(path), model)}
    assert steps == {100}
    # Without costs a custom schedule's tasks count 20 us each on the host, with no GPU work.
    t = plan.simulate(two_threads(), "legacy").timeline
    assert t.host_step_us == 40 and t.gpu == []
    # The HSTU figures are the default for the HSTU schedule, whichever way it is named.
    by_schedule = plan.simulate(hstu_schedule(cascade="d6"), "full_split").timeline.step_us
    assert by_schedule == plan.simulate("full_split_d6").timeline.step_us
    assert by_schedule == plan.simulate("full_split_d6", costs=plan.CostModel.hstu_defaults()
                                        ).timeline.step_us


def test_write_report_draws_the_nine_hstu_variants(tmp_path):
    path = tmp_path / "hstu.html"
    reports = plan.write_report(path)
    assert [r.name for r in reports] == VARIANT_NAMES
    html = path.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert "weft plan: HSTU thread-map presets" in html
    for name in VARIANT_NAMES:
        assert name in html
    assert html.count("<svg class=gantt") == 9
    # The collective inventory of the HSTU schedule is listed.
    assert "AllReduce" in html
    assert "<script" not in html


def test_write_report_of_given_variants_and_schedules(tmp_path):
    path = tmp_path / "custom.html"
    reports = plan.write_report(path, ["default_d6", ("mine", two_threads(), "per_task")],
                                costs=None, title="two of them")
    assert [(r.name, r.cascade) for r in reports] == [("default_d6", "d6"), ("mine", "custom")]
    html = path.read_text()
    assert "two of them" in html and "default_d6" in html and "mine" in html
    assert html.count("<svg class=gantt") == 2


def test_write_report_follows_links_and_writes_to_devices(tmp_path):
    target = tmp_path / "target.html"
    target.write_text("old")
    link = tmp_path / "link.html"
    link.symlink_to(target)
    plan.write_report(link, ["legacy_none"])
    assert link.is_symlink() and "legacy_none" in target.read_text()
    plan.write_report(os.devnull, ["legacy_none"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.html", "target.html"]


def busy_for(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_engine_trace_round_trips_into_a_report(tmp_path):
    # forward is the long pole, as on a real step; the rest take a little time each.
    bodies = {name: (lambda ctx, s=(1.5e-3 if name == "forward" else 1e-4): busy_for(s))
              for name in HSTU_TASK_NAMES}
    engine = Engine(hstu_schedule(bodies, cascade="d6"), "full_split", trace=True)
    assert len(drain(engine, range(24))) == 24
    trace_path = tmp_path / "run.trace.json"
    engine.take_trace().write_chrome_json(str(trace_path))
    engine.close()

    html_path = tmp_path / "run.html"
    v = plan.report_from_trace(trace_path, html_path)
    t = v.timeline
    assert v.source.startswith("trace")
    assert set(t.threads) == {"io", "data_dist", "prefetch", "compute"}
    assert sorted(s.task for s in t.host) == sorted(HSTU_TASK_NAMES)
    assert t.step_us >= 1500 and t.host_step_us >= 1500
    assert all(w.producer_thread != w.consumer_thread for w in t.waits)
    placement = {p.task: p for p in v.placement}
    assert placement["h2d"].lookahead == 5 and placement["forward"].thread == "compute"
    html = html_path.read_text()
    assert html.count("<svg class=gantt") == 1 and v.name in html

    # Drawn beside the simulated variant it ran.
    both = plan.write_report(tmp_path / "both.html", ["full_split_d6"], traces=[trace_path])
    assert [r.source for r in both] == ["simulated", v.source]


def test_bad_input_raises_weft_error(tmp_path):
    with pytest.raises(weft.Error, match="at least 4 progress"):
        plan.simulate("default_d3", num_steps=2)
    with pytest.raises(weft.Error, match="no_such_variant"):
        plan.simulate("no_such_variant")
    with pytest.raises(weft.Error, match=r"\$\.tasks\.A\.host_us"):
        plan.simulate(two_threads(), "per_task", {"tasks": {"A": {"host_us": -1}}})
    with pytest.raises(weft.Error, match="nowhere"):
        plan.simulate(two_threads(), "per_task", {"tasks": {"nowhere": {"host_us": 1}}})
    with pytest.raises(weft.Error):
        plan.simulate(two_threads(), "per_task", tmp_path / "missing.json")
    with pytest.raises(TypeError):
        plan.simulate(two_threads())
    with pytest.raises(TypeError):
        plan.simulate("default_d3", "per_task")

    not_a_trace = tmp_path / "not_a_trace.json"
    not_a_trace.write_text('{"traceEvents": 3}')
    html_path = tmp_path / "never.html"
    for bad in (not_a_trace, tmp_path / "missing.trace.json"):
        with pytest.raises(weft.Error):
            plan.report_from_trace(bad, html_path)
    assert not html_path.exists()
    with pytest.raises(weft.Error):
        plan.write_report(html_path, ["default_d3"], costs={"tasks": {"nowhere": {}}})
    assert not html_path.exists()
    assert list(tmp_path.iterdir()) == [not_a_trace]
