"""The planner over the MoE step (weft.moe.planning, weft.step_planning): costs from a traced
step name every task of every layer; the helpers shared with the HSTU step give the numbers
they gave there; the search is deterministic and keeps to the layouts the step holds (and a
schedule outside them is refused); a suggestion's config file runs on the engine with the serial
step's bits; and bench/python/moe_pipeline.py --suggest runs it beside the depths with each
prediction's error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
import weft.moe as moe  # noqa: E402
from weft import plan  # noqa: E402
from weft.hstu import planning as hstu_planning  # noqa: E402
from weft.hstu.variants import step_variants  # noqa: E402
from weft.moe.planning import (MoeVariant, check_layouts, count_waits,  # noqa: E402
                               depth_variants, merged_trace, suggest_variant,
                               variant_from_config)
from weft.pipeline import ScheduleConfig, ThreadMap  # noqa: E402
from weft.step_planning import (Calibration, calibrated_costs, fit_calibration,  # noqa: E402
                                predicted_ms, rms_error_pct)
from test_moe_pipeline import (SMALL, _check_steps, _inputs, _one_layout_slots,  # noqa: E402
                               _relayouts)

REPO = Path(__file__).parents[2]
HOST_BOUND_COSTS = str(REPO / "tests" / "cpu" / "plan" / "data" / "costs_hstu_host_bound.json")
L, M = SMALL["num_layers"], 4

# Fixed costs: every compute stage's host and GPU work, the communication's host waits.
GPU_US = {"dense_router": 300, "dispatch": 400, "experts": 900, "combine": 400, "loss": 100,
          "combine_bwd": 400, "experts_bwd": 900, "dispatch_bwd": 400, "experts_wgrad": 600,
          "dense_router_bwd": 500}
FIXED_COSTS = moe.moe_costs(L, GPU_US, host_us=150.0)


def _traced_costs(num_steps=2):
    model = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=1, **SMALL)
    step = moe.PipelinedStep(model, moe.LayoutSlots.shared(moe.LocalDispatcher(8), L), M,
                             depth=0, trace=True)
    x, target = _inputs(0)
    traces = []
    for _ in range(num_steps):
        step(x, target, lr=0.0)
        traces.append(step.engine.take_trace())
    schedule = step.schedule
    step.close()
    return traces, schedule


@pytest.mark.timeout(120)
def test_costs_from_a_traced_step_name_every_task_of_every_layer():
    traces, schedule = _traced_costs()
    merged = merged_trace(traces)
    names = [t.name for t in schedule.tasks]
    # Batches run on from step to step: each run of a task is its own.
    for i in range(len(names)):
        runs = [(s.batch, s.iteration) for s in merged.host_spans if s.task == i]
        assert len(runs) == len(set(runs)) == 2 * M
    costs = plan.trace_costs(merged, schedule)
    assert sorted(costs["tasks"]) == sorted(names)
    assert len(names) == 4 * L + 1 + 5 * L  # each layer's tasks apart
    assert {"dispatch_0", "dispatch_1", "experts_wgrad_0", "experts_wgrad_1"} <= set(names)
    assert all(t["host_us"] > 0 for t in costs["tasks"].values())
    # The host backend records no GPU spans; the costs simulate as they are.
    assert predicted_ms(depth_variants(L, [1], M)[0], costs) > 0
    with pytest.raises(weft.Error, match="no traces"):
        merged_trace([])


@pytest.mark.timeout(60)
def test_the_count_waits_simulate_under_every_depth_and_cost_the_wait_they_make():
    # experts_l waits for dispatch_l's GPU work of its micro-batch (NativeEpDispatcher's count).
    assert count_waits(2) == {"experts_0": "dispatch_0", "experts_1": "dispatch_1"}
    waits = json.loads(json.dumps(FIXED_COSTS))
    for task, producer in count_waits(L).items():
        waits["tasks"][task]["waits_for_gpu_of"] = producer
    # Every depth of the family (under the step's map and one thread) has the dispatch before the
    # experts stage, so no wait is refused; at depth 0 on one thread every experts stage waits
    # for its dispatch's 400 us of GPU work, which the plain costs do not make it do.
    for v in depth_variants(L, [0, 1, 4, 8], M):
        for thread_map in (v.thread_map, "legacy"):
            assert predicted_ms(v._replace(thread_map=thread_map), waits) > 0
    serial = depth_variants(L, [0], M)[0]._replace(thread_map="legacy")
    assert predicted_ms(serial, waits) > predicted_ms(serial, FIXED_COSTS)


@pytest.mark.timeout(60)
def test_the_shared_helpers_give_the_hstu_step_its_numbers():
    variants = step_variants()
    assert hstu_planning.predicted_ms is predicted_ms
    assert hstu_planning.fit_calibration is fit_calibration
    for v in variants:
        report = plan.simulate(v.schedule(), v.thread_map, HOST_BOUND_COSTS, name=v.name)
        assert predicted_ms(v, HOST_BOUND_COSTS) == report.timeline.step_us / 1e3
    truth = Calibration(200.0, "all")
    measured = {v.name: predicted_ms(v, HOST_BOUND_COSTS, truth) for v in variants}
    fit = fit_calibration(measured, variants, HOST_BOUND_COSTS)
    assert fit[:2] == (200.0, "all") and rms_error_pct(measured, variants, HOST_BOUND_COSTS,
                                                       fit) == 0


@pytest.mark.timeout(60)
def test_a_moe_step_is_one_source_of_its_micro_batches():
    """Simulated whole, fill and drain included: every task once per micro-batch, and more than
    M steady-state progress() calls (the prefill and the drain run partial iterations)."""
    v = depth_variants(L, [3], M)[0]
    assert v.source_batches == M
    source = plan.simulate(moe.moe_schedule(L, 3), moe.moe_thread_map(L), FIXED_COSTS,
                           num_batches=M)
    assert predicted_ms(v, FIXED_COSTS) == source.timeline.step_us / 1e3
    runs = sorted((h.task, h.batch) for h in source.timeline.host)
    assert runs == sorted((t.name, b) for t in v.schedule().tasks for b in range(M))
    steady = plan.simulate(moe.moe_schedule(L, 3), moe.moe_thread_map(L), FIXED_COSTS)
    assert source.timeline.step_us > M * steady.timeline.step_us
    assert v.layouts() == moe.num_layout_slots(L, 3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_slots", [None, [8, 4], [2, 2], [3, 1], [1, 1]])
def test_the_search_is_deterministic_and_keeps_to_the_layouts(num_slots):
    a = suggest_variant(FIXED_COSTS, L, M, num_slots=num_slots)
    b = suggest_variant(FIXED_COSTS, L, M, num_slots=num_slots)
    assert a.variant.config.to_json() == b.variant.config.to_json()
    assert (a.step_ms, a.source, a.describe()) == (b.step_ms, b.source, b.describe())
    assert predicted_ms(a.variant, FIXED_COSTS) == pytest.approx(a.step_ms)
    if num_slots is not None:
        assert all(n <= h for n, h in zip(a.variant.layouts(), num_slots))
        assert "not searched: lookaheads above" in a.describe()
    # No depth of the family whose layouts fit predicts less.
    for v in depth_variants(L, range(moe.max_depth(L) + 1), M):
        if num_slots is None or all(n <= h for n, h in zip(v.layouts(), num_slots)):
            assert a.step_ms <= predicted_ms(v, FIXED_COSTS) + 1e-9
    # Every candidate is simulated as the step's source: the fill and drain are searched.
    assert "fill and drain" not in a.describe()


@pytest.mark.timeout(120)
def test_the_search_of_the_family_with_each_dispatch_after_its_router():
    """dispatch_after_router: the variants are that family's (depth up to 5L) and the search
    simulates its depths; its pick is no worse than any of them."""
    deepest = moe.max_depth(L, True)
    family = depth_variants(L, range(deepest + 1), M, dispatch_after_router=True)
    for v in family:
        assert {t.name: t.lookahead for t in v.schedule().tasks} == \
            moe.stage_lookaheads(L, v.depth, True)
    found = suggest_variant(FIXED_COSTS, L, M, dispatch_after_router=True)
    assert f"d{deepest}" in found.describe() and found.variant.dispatch_after_router
    assert all(found.step_ms <= predicted_ms(v, FIXED_COSTS) + 1e-9 for v in family)
    assert suggest_variant(FIXED_COSTS, L, M).variant.dispatch_after_router is False


@pytest.mark.timeout(120)
def test_a_gain_inside_min_gain_pct_keeps_the_steps_own_schedule():
    # With [2, 2] layouts the lookahead search finds a schedule 0.1 ms (0.3%) below the best
    # depth that fits: a gain the default min_gain_pct (1%) does not take.
    slots = [2, 2]
    lowest = suggest_variant(FIXED_COSTS, L, M, num_slots=slots, min_gain_pct=0)
    own = min(predicted_ms(v, FIXED_COSTS) for v in depth_variants(L, range(moe.max_depth(L) + 1), M)
              if all(n <= h for n, h in zip(v.layouts(), slots)))
    gain_pct = 100 * (1 - lowest.step_ms / own)
    assert lowest.source == "lookahead search" and 0 < gain_pct < 1
    kept = suggest_variant(FIXED_COSTS, L, M, num_slots=slots)
    assert kept.step_ms == pytest.approx(own)
    assert kept.source.startswith("depth family d")
    assert kept.variant.config.thread_map == ThreadMap.of(moe.moe_thread_map(L))
    assert "searched: kept the step's own schedule (depth family d" in kept.describe()
    assert "within min_gain_pct 1%" in kept.describe()
    # The step's own map is the caller's: one thread, the family under legacy.
    one = suggest_variant(FIXED_COSTS, L, M, num_slots=slots,
                          own_thread_map=moe.moe_thread_map(L, 1))
    assert one.source.startswith("depth family d")
    assert one.variant.config.thread_map == ThreadMap.of(moe.moe_thread_map(L, 1))
    assert suggest_variant(FIXED_COSTS, L, M, num_slots=slots,
                           min_gain_pct=gain_pct / 2).step_ms == pytest.approx(lowest.step_ms)
    with pytest.raises(ValueError, match="min_gain_pct must be >= 0"):
        suggest_variant(FIXED_COSTS, L, M, min_gain_pct=-1)


@pytest.mark.timeout(60)
def test_a_schedule_outside_the_layouts_is_refused(tmp_path):
    deep = depth_variants(L, [moe.max_depth(L)], M)[0]
    with pytest.raises(weft.Error, match=r"keeps \[8, 4\] layouts per layer live at once; the "
                                         r"step's layout slots hold \[2, 2\]"):
        check_layouts(deep, [2, 2])
    check_layouts(deep, [8, 4])
    check_layouts(deep, None)
    path = tmp_path / "deep.json"
    path.write_text(json.dumps({"thread_map": "legacy",
                                "lookahead": moe.stage_lookaheads(L, moe.max_depth(L))}))
    with pytest.raises(weft.Error, match="layouts per layer"):
        variant_from_config(path, L, M, num_slots=[2, 2])
    assert variant_from_config(path, L, M, num_slots=[8, 4]).layouts() == [8, 4]
    # The engine refuses it too, before any engine starts.
    model = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), **SMALL)
    with pytest.raises(ValueError, match=r"keeps \[8, 4\] layouts per layer live"):
        moe.PipelinedStep(model, _one_layout_slots([2, 2]), M, depth=0,
                          config=ScheduleConfig.load(str(path)))
    no_map = tmp_path / "no_map.json"
    no_map.write_text(json.dumps({"lookahead": {"loss": 1}}))
    with pytest.raises(weft.Error, match="no \"thread_map\""):
        variant_from_config(no_map, L, M)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_slots", [[2, 2], [8, 4]])
def test_a_suggestions_config_runs_with_the_serial_steps_bits(tmp_path, num_slots):
    found = suggest_variant(FIXED_COSTS, L, M, num_slots=num_slots,
                            calibration=Calibration(50.0, "all"))
    path = tmp_path / "pick.json"
    found.write_config(path)
    again = variant_from_config(path, L, M, num_slots=num_slots)
    assert again.name == "pick" and again.config == found.variant.config
    assert predicted_ms(again, FIXED_COSTS) == predicted_ms(found.variant, FIXED_COSTS)
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=5, **SMALL)
    piped = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=5, **SMALL)
    ref = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=5, **SMALL)
    slots = _one_layout_slots(num_slots)
    step = moe.PipelinedStep(piped, slots, M, depth=again.depth,
                             config=ScheduleConfig.load(str(path)))
    assert step.lookaheads == found.variant.config.lookahead
    _check_steps(serial, piped, ref, step, [_inputs(i) for i in range(3)], lr=0.05)
    step.close()
    assert _relayouts(slots) == 0  # a Buffer per live layout: none re-run


def _table_rows(stdout):
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("schedule "))
    rows = {}
    for line in lines[header + 1:]:
        if line.startswith("#"):
            break
        name = line[:30].strip()
        rows[name] = line[30:].split()
    return lines[header], rows


@pytest.mark.timeout(300)
def test_moe_pipeline_suggest_runs_the_suggestion_and_prints_each_error(tmp_path):
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(weft.__file__)))
    env["PYTHONPATH"] = package_parent + os.pathsep + env.get("PYTHONPATH", "")
    args = ["--device", "cpu", "--shapes", "tiny", "--tokens", "64", "--layers", "2",
            "--depth", "1,max", "--warmup", "1", "--iters", "2", "--repeats", "2",
            "--suggest", "--calibrate", "--trace-dir", str(tmp_path)]
    run = subprocess.run([sys.executable, str(REPO / "bench" / "python" / "moe_pipeline.py"),
                          *args], env=env, capture_output=True, text=True, timeout=280,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "# costs: (c) pipe+a2a d0's traced run (2 steps), 19 tasks" in out
    assert "# calibration, fitted on the traced runs of 3 depths (d0, d1, d10): wake-up" in out
    assert "#   not searched: more than 2 threads" in out
    assert "fill and drain" not in out.split("# suggested")[1].split("schedule ")[0]
    header, rows = _table_rows(out)
    assert "planner ms" in header and "err %" in header and "fit err %" in header
    assert list(rows) == ["(a) a2a", "(c) pipe+a2a d1", "(c) pipe+a2a d10",
                          "(c) pipe+a2a suggested"]
    for name, fields in rows.items():
        assert fields[-1] == "identical", name
        predicted, error, fit_predicted, fit_error = fields[-5:-1]
        if name == "(a) a2a":
            assert (predicted, error, fit_predicted, fit_error) == ("-",) * 4
        else:
            float(predicted), float(fit_predicted)
            assert error[0] in "+-" and fit_error[0] in "+-"
    assert "# planner error over the 3 engine rows (timed medians): rms" in out
    assert "# every row bit-identical to (a) a2a" in out
    config_path = tmp_path / "moe_tiny_T64_suggested.json"
    assert f"config in {config_path}" in out
    variant = variant_from_config(config_path, 2, 4)
    assert isinstance(variant, MoeVariant) and variant.config.thread_map is not None
    assert (tmp_path / "moe_tiny_T64_d0.trace.json").is_file()


@pytest.mark.timeout(300)
def test_moe_pipeline_interleave_times_every_schedule_each_run(tmp_path):
    """--interleave: every schedule built first, then run r of each after run r - 1 of all; each
    row has its --repeats runs, the bits check and the engine threads as without it ((c)'s max
    is 5 x layers, each dispatch a progress after its router, on one thread)."""
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(weft.__file__)))
    env["PYTHONPATH"] = package_parent + os.pathsep + env.get("PYTHONPATH", "")
    args = ["--device", "cpu", "--shapes", "tiny", "--tokens", "64", "--layers", "1",
            "--micro-batches", "2", "--depth", "1,max", "--warmup", "0", "--iters", "1",
            "--repeats", "3", "--interleave"]
    run = subprocess.run([sys.executable, str(REPO / "bench" / "python" / "moe_pipeline.py"),
                          *args], env=env, capture_output=True, text=True, timeout=280,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    rows = [line.split() for line in lines if line.startswith("tiny") and line.endswith("x")]
    assert [" ".join(r[2:-2]) for r in rows] == ["(a) a2a", "(c) pipe+a2a d1",
                                                 "(c) pipe+a2a d5", "no comm"]
    for r in rows:
        low, high = map(float, r[-2].split("-"))
        assert 0 < low <= high, r
    assert "tiny       64 the first step's loss and every gradient bit-identical across " \
           "schedules: True" in lines
    assert "tiny       64 engine threads: (c) pipe+a2a 1" in lines


@pytest.mark.timeout(60)
def test_moe_pipeline_bits_tell_one_flipped_gradient_bit():
    # The bench compares every schedule's first step with the first schedule's, kept on the host
    # and read back a chunk at a time: one flipped bit anywhere (a chunk past the first
    # included) is a difference, a NaN equals itself, -0 differs from 0.
    sys.path.insert(0, str(REPO / "bench" / "python"))
    try:
        import moe_pipeline as bench
    finally:
        sys.path.pop(0)
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn(p.shape).to(torch.bfloat16)
    model.bias.grad[1] = float("nan")
    loss = torch.tensor(0.25)
    reference = bench.host_bits(loss, model)
    assert bench.same_bits(loss, model, reference, chunk_bytes=4)
    words = model.weight.grad.view(torch.int16).view(-1)
    words[-1] ^= 1
    assert not bench.same_bits(loss, model, reference, chunk_bytes=4)
    words[-1] ^= 1
    assert bench.same_bits(loss, model, reference, chunk_bytes=4)
    assert not bench.same_bits(torch.tensor(0.5), model, reference)
    model.bias.grad[0] = 0.0
    reference = bench.host_bits(loss, model)
    model.bias.grad[0] = -0.0
    assert not bench.same_bits(loss, model, reference)


@pytest.mark.timeout(300)
def test_moe_pipeline_suggest_at_two_ranks_plans_with_rank_0s_figures(tmp_path):
    # Two CPU ranks (gloo, the all_to_all dispatcher): every rank runs the traced steps, plans
    # with rank 0's costs (checked: the same suggestion), and runs the suggestion with the
    # serial step's bits; rank 0 alone prints and writes the files. A bench-out/ folder: every
    # rank runs the traced step drawn there (collective), rank 0 writes it.
    (tmp_path / "bench-out").mkdir()
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(weft.__file__)))
    env["PYTHONPATH"] = package_parent + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    args = ["--device", "cpu", "--shapes", "tiny", "--tokens", "64", "--layers", "2",
            "--depth", "1", "--warmup", "1", "--iters", "1", "--repeats", "1", "--suggest",
            "--trace-dir", str(tmp_path)]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(REPO / "bench" / "python" / "moe_pipeline.py"),
                          *args], env=env, capture_output=True, text=True, timeout=280,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "CPU x 2" in out
    assert out.count("# suggested (") == 1  # rank 0 prints
    assert "# every row bit-identical to (a) a2a" in out and "MISMATCH" not in out
    variant_from_config(tmp_path / "moe_tiny_T64_suggested.json", 2, 4)
    assert out.count("# wrote ") == 1
    assert (tmp_path / "bench-out" / "moe_pipeline_tiny_T64_d1.trace.json").is_file()


@pytest.mark.timeout(120)
def test_the_fit_recovers_a_compute_stream_slowdown():
    variants = depth_variants(L, [0, 1, 4, 8], M)
    truth = Calibration(0.0, None, slowdown=("default", 1.3))
    slowed = calibrated_costs(FIXED_COSTS, truth)
    assert slowed["tasks"]["experts_0"]["gpu"] == [{"stream": "default", "us": 900 * 1.3}]
    assert slowed["tasks"]["dispatch_0"]["gpu"] == [{"stream": "comm", "us": 400}]
    assert FIXED_COSTS["tasks"]["experts_0"]["gpu"][0]["us"] == 900  # not changed in place
    measured = {v.name: predicted_ms(v, FIXED_COSTS, truth) for v in variants}
    assert rms_error_pct(measured, variants, FIXED_COSTS) > 5
    fit = fit_calibration(measured, variants, FIXED_COSTS, slowdown_stream="default")
    assert fit.slowdown == ("default", 1.3) and fit.rms_error_pct == pytest.approx(0, abs=1e-9)
    assert "stream default's GPU work x 1.3" in fit.describe()
    assert fit_calibration(measured, variants, FIXED_COSTS).slowdown is None
    found = suggest_variant(FIXED_COSTS, L, M, calibration=fit)
    assert predicted_ms(found.variant, FIXED_COSTS, fit) == pytest.approx(found.step_ms)
    with pytest.raises(weft.Error, match="needs the costs as a dict"):
        predicted_ms(variants[0], HOST_BOUND_COSTS, truth)


@pytest.mark.timeout(60)
def test_one_thread_and_one_layout_leave_the_serial_order():
    found = suggest_variant(FIXED_COSTS, L, M, num_slots=[1, 1], max_threads=1)
    assert found.result is None and found.num_threads == 1
    assert found.variant.layouts() == [1, 1]
    assert set(found.variant.config.lookahead.values()) == {0}
