"""weft.pipeline on the host backend: the task API, the step rule, slots, thread maps, the JSON
config, the HSTU presets, traces, the stall report and the collective inventory."""

import json
import threading

import pytest

from conftest import drain

import weft
from weft.pipeline import (CollectiveOp, Engine, HSTU_TASK_NAMES, Schedule, ScheduleConfig,
                           SyncSide, Task, ThreadMap, hstu_schedule, hstu_variant, hstu_variants)

pytestmark = pytest.mark.timeout(120)

MAPS = ["legacy", "per_task", "by_stream", "default"]


def two_stage(record=None):
    """h2d (la 1, its own stream) doubles the input; train (la 0) pairs it with its batch index."""
    def h2d(ctx):
        ctx.set("batch", ctx.get("batch_cpu") * 2)

    def train(ctx):
        if record is not None:
            record.append((ctx.iteration, ctx.batch_index))
        ctx.set("step_result", (ctx.batch_index, ctx.get("batch")))

    return Schedule([
        Task.from_fn("h2d", h2d, stream="memcpy", lookahead=1, reads=["batch_cpu"],
                     writes=["batch"]),
        Task.from_fn("train", train, reads=["batch"], writes=["step_result"]),
    ])


@pytest.mark.parametrize("thread_map", MAPS)
@pytest.mark.parametrize("num_batches", [0, 1, 2, 7])
def test_m_batches_in_give_m_results_then_stop_iteration(thread_map, num_batches):
    engine = Engine(two_stage(), thread_map)
    it = iter(range(num_batches))
    results = []
    for _ in range(num_batches):
        results.append(engine.progress(it))
    assert results == [(i, 2 * i) for i in range(num_batches)]
    for _ in range(3):  # and keeps saying so
        with pytest.raises(StopIteration):
            engine.progress(it)


def test_prefill_and_drain_follow_the_step_rule():
    record = []
    engine = Engine(two_stage(record), "legacy")
    assert drain(engine, range(3)) == [(0, 0), (1, 2), (2, 4)]
    # max_la = 1: train runs at iterations 1..3 on batches 0..2 (iteration 0 is the prefill).
    assert record == [(1, 0), (2, 1), (3, 2)]


def test_subclass_form_with_init_and_run():
    inits = []

    class Scale(Task):
        name = "scale"
        reads = ("batch_cpu",)
        writes = ("step_result",)

        def init(self, ctx):
            inits.append((ctx.name, threading.current_thread() is threading.main_thread()))
            self.factor = 3

        def run(self, ctx):
            ctx.set("step_result", ctx.get("batch_cpu") * self.factor)

    engine = Engine(Schedule([Scale()]), "per_task")
    assert inits == [("scale", False)]  # on the task's engine thread, once
    assert drain(engine, [1, 2]) == [3, 6]
    assert inits == [("scale", False)]


def test_slots_hold_any_python_object_and_results_may_be_none():
    class Thing:
        pass

    thing = Thing()

    def produce(ctx):
        ctx.set("obj", {"thing": thing, "list": [ctx.get("batch_cpu")]})

    def consume(ctx):
        obj = ctx.get("obj")
        assert obj["thing"] is thing
        if obj["list"][0] % 2:
            ctx.set("step_result", obj["list"])

    s = Schedule([Task.from_fn("p", produce, reads=["batch_cpu"], writes=["obj"], stream="a"),
                  Task.from_fn("c", consume, reads=["obj"], writes=["step_result"])])
    assert drain(Engine(s, "per_task"), range(4)) == [None, [1], None, [3]]


def test_several_inputs_come_from_a_mapping_per_item():
    s = Schedule([Task.from_fn("add", lambda c: c.set("step_result", c.get("x") + c.get("y")),
                               reads=["x", "y"], writes=["step_result"])], inputs=["x", "y"])
    assert drain(Engine(s, "legacy"), [{"x": 1, "y": 2}, {"x": 5, "y": 5}]) == [3, 10]


def test_context_checks_declarations_and_dies_with_its_body():
    kept = []

    def body(ctx):
        kept.append(ctx)
        assert ctx.has("batch_cpu") and not ctx.has("out")
        with pytest.raises(weft.Error, match="without declaring it"):
            ctx.get("secret")
        with pytest.raises(weft.Error, match="without declaring it in writes"):
            ctx.set("batch_cpu", 1)
        ctx.set("out", 1)

    s = Schedule([Task.from_fn("t", body, reads=["batch_cpu"], writes=["out"]),
                  Task.from_fn("secretive", None, writes=["secret"])])
    drain(Engine(s, "legacy"), [0])
    with pytest.raises(weft.Error, match="outside its task's body"):
        kept[0].get("batch_cpu")


def test_context_reports_the_task():
    seen = {}

    def body(ctx):
        seen[ctx.name] = (ctx.lookahead, ctx.stream, ctx.backend, ctx.ticket, ctx.batch_index)

    s = Schedule([Task.from_fn("a", body, lookahead=1, stream="io", collective=True),
                  Task.from_fn("b", body, collective=True, nccl=True)])
    drain(Engine(s, "per_task"), [0])
    # One batch: a (la 1) runs alone at iteration 0, b at iteration 1; each holds ticket 0.
    assert seen == {"a": (1, "io", "host", 0, 0), "b": (0, "default", "host", 0, 0)}


def test_validation_errors_name_the_task_and_rule():
    s = Schedule([Task.from_fn("a", None, reads=["ghost"])])
    with pytest.raises(weft.Error, match="task 'a' reads slot 'ghost'"):
        s.validate()
    with pytest.raises(weft.Error, match="ghost"):
        Engine(s, "legacy")
    with pytest.raises(weft.Error, match=r"'b'.*offset 0.*cross_iter offsets are < 0"):
        Task.from_fn("b", None, cross_iter_depends_on=[("a", 0)])
    with pytest.raises(ValueError, match="disagree"):
        Task.from_fn("b", None, collective=True, nccl=False)


def test_task_fields_normalise_like_the_seed():
    t = Task.from_fn("t", None, reads="x", depends_on="p", cross_iter_depends_on=["q", ("r", -2)],
                     same_progress_sync=["s", ("u", SyncSide.GPU), {"task": "v", "sides": "cpu"}],
                     collective=[("AllReduce", "default", 8, 1)])
    assert t.reads == ("x",) and t.depends_on == ("p",)
    assert t.cross_iter_depends_on == (("q", -1), ("r", -2))
    assert t.same_progress_sync == (("s", SyncSide.BOTH), ("u", SyncSide.GPU), ("v", SyncSide.CPU))
    assert t.collective and t.inventory == (CollectiveOp("AllReduce", "default", 8, 1),)


def test_custom_maps_and_presets():
    s = two_stage()
    e = Engine(s, {"io": ["h2d"], "compute": ["train"]})
    assert e.threads == {"io": ["h2d"], "compute": ["train"]}
    assert drain(e, range(3)) == [(i, 2 * i) for i in range(3)]
    e = Engine(s, ThreadMap.groups({"io": ["h2d"]}, rest="main_loop"))
    assert e.threads == {"io": ["h2d"], "main_loop": ["train"]}
    with pytest.raises(weft.Error, match="ghost"):
        Engine(s, {"io": ["h2d", "ghost"], "compute": ["train"]})
    with pytest.raises(weft.Error):
        ThreadMap.preset("nonsense")
    assert set(ThreadMap.preset_names()) >= {"legacy", "default", "by_stream", "per_task",
                                            "io_prefetch_compute", "io_data_dist_compute",
                                            "full_split"}


def test_new_iterator_mid_flight_is_refused_until_reset():
    e = Engine(two_stage(), "per_task")
    it = iter(range(10))
    assert e.progress(it) == (0, 0)
    with pytest.raises(weft.Error, match="in flight"):
        e.progress(iter(range(3)))
    e.reset()
    assert drain(e, range(2)) == [(0, 0), (1, 2)]


def test_hstu_presets_with_python_bodies_under_every_variant():
    assert len(HSTU_TASK_NAMES) == 14
    variants = hstu_variants()
    assert [v.name for v in variants][0] == "legacy_none" and len(variants) == 9
    assert hstu_variant("full_split_d6") == ("full_split_d6", "d6", "full_split")
    for v in variants:
        runs = []
        lock = threading.Lock()

        def body(ctx):
            with lock:
                runs.append((ctx.name, ctx.batch_index))

        def optimizer_step(ctx):
            body(ctx)
            ctx.set("step_result", ctx.batch_index)

        bodies = {name: body for name in HSTU_TASK_NAMES}
        bodies["optimizer_step"] = optimizer_step
        e = Engine(hstu_schedule(bodies, cascade=v.cascade), v.thread_map)
        assert drain(e, range(5)) == list(range(5)), v.name
        assert sorted(runs) == sorted((n, b) for n in HSTU_TASK_NAMES for b in range(5)), v.name
    with pytest.raises(weft.Error, match="no HSTU task"):
        hstu_schedule({"ghost": body})


def test_json_config_tunes_the_schedule():
    config = ScheduleConfig.from_dict({
        "thread_map": {"groups": {"io": ["h2d", "start_shuffle", "finish_shuffle"]},
                       "rest": "compute"},
        "lookahead": {"h2d": 5, "start_shuffle": 4, "finish_shuffle": 3},
        "same_progress_sync": [{"producer": "prefetch_embeddings", "consumer": "backward",
                                "side": "gpu"}],
    })
    s = hstu_schedule({"optimizer_step": lambda c: c.set("step_result", c.batch_index)})
    config.apply(s)
    assert s.task("h2d").lookahead == 5
    assert s.task("backward").same_progress_sync == (("prefetch_embeddings", SyncSide.GPU),)
    assert ScheduleConfig.parse(config.to_json()) == config
    e = Engine(s, config.thread_map)
    assert set(e.threads) == {"io", "compute"}
    assert drain(e, range(8)) == list(range(8))
    with pytest.raises(weft.Error, match=r"\$\.lookahead\.ghost"):
        ScheduleConfig.from_dict({"lookahead": {"ghost": 1}}).apply(s)


def test_trace_writes_chrome_json(tmp_path):
    e = Engine(two_stage(), "per_task", trace=True)
    drain(e, range(4))
    trace = e.take_trace()
    assert trace.task_names == ["h2d", "train"]
    assert len(trace.host_spans) == 8
    assert all(s.end_us >= s.begin_us for s in trace.host_spans)
    path = tmp_path / "t.json"
    trace.write_chrome_json(str(path))
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(ev.get("name") == "train" for ev in events)


def test_stall_report_names_the_sleeping_task(capfd):
    import time
    s = Schedule([Task.from_fn("sleepy", lambda c: time.sleep(0.5), reads=["batch_cpu"],
                               writes=["x"]),
                  Task.from_fn("waiter", None, reads=["x"], stream="other")])
    drain(Engine(s, "per_task", stall_report_s=0.1), [0])
    err = capfd.readouterr().err
    assert "thread 'sleepy': in task 'sleepy', running its body" in err
    assert "thread 'waiter': in task 'waiter', waiting for task 'sleepy'" in err


def test_collective_inventory_from_record_collective():
    def allreduce(ctx):
        ctx.record_collective("AllReduce", "default", 1024)
        ctx.record_collective("AllReduce", "default", 3072)

    def not_collective(ctx):
        with pytest.raises(weft.Error, match="not marked collective"):
            ctx.record_collective("AllGather", "default", 8)

    inventory = [CollectiveOp("AllReduce", "default", 2048, 2)]
    s = Schedule([Task.from_fn("grads", allreduce, collective=inventory),
                  Task.from_fn("other", not_collective)])
    e = Engine(s, "per_task")
    drain(e, range(3))
    assert e.collective_inventory() == [{"task": "grads", "kind": "AllReduce", "stream": "default",
                                         "bytes_per_call": 2048.0, "calls_per_run": 2.0}]


def test_engine_closes_and_a_cycle_through_bodies_is_collected():
    import gc
    import weakref

    class Holder:
        pass

    h = Holder()
    h.engine = Engine(Schedule([Task.from_fn("t", lambda c: h, reads=["batch_cpu"])]), "per_task")
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None


def test_torch_backend_without_a_gpu_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: test_pipeline_gpu.py covers the torch backend")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        Engine(two_stage(), "legacy", backend="torch")


def test_the_torch_backends_stream_calls_are_in_this_torch():
    # The "torch" backend sets each body's stream with torch's calls under
    # torch.cuda.current_stream and set_stream; every supported torch (a CUDA build) has them,
    # and one without them is refused by name.
    from types import SimpleNamespace

    from weft.pipeline.torch_streams import stream_state_calls

    torch = pytest.importorskip("torch")
    if not torch.backends.cuda.is_built():
        pytest.skip("a torch built without CUDA has no CUDA streams")
    get, put = stream_state_calls(torch)
    assert callable(get) and callable(put)
    with pytest.raises(RuntimeError, match="_cuda_getCurrentStream and _cuda_setStream, which "
                                           "torch 0.0 lacks"):
        stream_state_calls(SimpleNamespace(_C=SimpleNamespace(), __version__="0.0"))


def test_adopted_streams_need_the_torch_backend():
    with pytest.raises(ValueError, match="streams= needs backend='torch'"):
        Engine(two_stage(), "legacy", streams={"memcpy": object()})


def test_sync_sides_cross_the_binding_as_the_bound_enum():
    from weft import _weft
    native_side = _weft.pipeline.SyncSide
    assert {side.name for side in native_side} == {"CPU", "GPU", "BOTH"}
    s = Schedule([Task.from_fn("a", None),
                  Task.from_fn("b", None, same_progress_sync=[("a", SyncSide.GPU)])])
    assert s._to_native(with_bodies=False).tasks[1].same_progress_sync == [
        ("a", native_side.GPU)]
    ScheduleConfig.from_dict({"same_progress_sync": [
        {"producer": "a", "consumer": "b", "side": "cpu"}]}).apply(s)
    assert s.task("b").same_progress_sync == (("a", SyncSide.CPU),)
    assert ScheduleConfig.from_dict({"same_progress_sync": [
        {"producer": "a", "consumer": "b", "side": "both"}]}).same_progress_sync == [
        ("a", "b", SyncSide.BOTH)]


def test_a_config_changes_the_python_tasks_directly_and_nothing_on_a_bad_name():
    s = Schedule([Task.from_fn("a", None, lookahead=1),
                  Task.from_fn("b", None, same_progress_sync=[("a", SyncSide.GPU)])])
    before = (s.task("a").lookahead, s.task("b").same_progress_sync)
    with pytest.raises(weft.Error, match=r"\$\.same_progress_sync\[0\]\.producer.*'ghost'"):
        ScheduleConfig.from_dict({"lookahead": {"a": 3}, "same_progress_sync": [
            {"producer": "ghost", "consumer": "b"}]}).apply(s)
    assert (s.task("a").lookahead, s.task("b").same_progress_sync) == before
    ScheduleConfig.from_dict({"lookahead": {"b": 2}, "same_progress_sync": [
        {"producer": "a", "consumer": "b", "side": "both"},
        {"producer": "b", "consumer": "a", "side": "cpu"}]}).apply(s)
    assert s.task("b").lookahead == 2
    assert s.task("b").same_progress_sync == (("a", SyncSide.BOTH),)
    assert s.task("a").same_progress_sync == (("b", SyncSide.CPU),)
