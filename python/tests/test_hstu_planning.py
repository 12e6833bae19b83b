"""The planner over the HSTU step (weft.hstu.planning, weft.hstu.variants): the step's schedule
declares h2d movable to a stream of its own, a config moving it runs with the default map's bits,
the suggestion for fixed costs is always the same one and round-trips through its config file,
and bench/python/hstu_step.py --suggest runs it beside the variants with each prediction's
error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import weft
from weft.hstu import hstu_schedule
from weft.hstu.planning import (Calibration, error_pct, fit_calibration, predicted_ms,
                                rms_error_pct, suggest_variant,
                                variant_from_config)
from weft.hstu.variants import LOADER_STREAM, StepVariant, step_schedule, step_variants
from weft.pipeline import ScheduleConfig

REPO = Path(__file__).parents[2]
HOST_BOUND_COSTS = str(REPO / "tests" / "cpu" / "plan" / "data" / "costs_hstu_host_bound.json")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cascade", ["d3", "d6"])
def test_the_step_schedule_declares_h2d_movable_to_the_loader_stream(cascade):
    schedule = step_schedule(cascade=cascade)
    schedule.validate()
    assert LOADER_STREAM in schedule.streams
    movable = {t.name: t.movable_to for t in schedule.tasks if t.movable_to}
    assert movable == {"h2d": (LOADER_STREAM,)}
    assert schedule.task("h2d").stream == "memcpy"  # declared free to move, not moved
    # The preset itself (the C++ one, as `weft plan` simulates it) keeps every stream fixed.
    assert not any(t.movable_to for t in hstu_schedule(cascade=cascade).tasks)


@pytest.mark.timeout(60)
def test_loader_split_is_the_move_and_other_moves_are_refused():
    loader = next(v for v in step_variants() if v.name == "loader_split_d6")
    assert loader.schedule().task("h2d").stream == LOADER_STREAM
    bad = StepVariant("bad", "d6", "legacy",
                      ScheduleConfig.from_dict({"stream": {"forward": LOADER_STREAM}}))
    with pytest.raises(weft.Error, match="task 'forward' cannot move to stream 'loader'"):
        bad.schedule()


def check_moved_h2d(rank, world_size):
    """The step under the legacy map (h2d on memcpy) and under configs moving h2d to the loader
    stream (on the main thread, and on a thread of its own): the same losses and parameters."""
    import torch

    from conftest import drain
    from weft.hstu.data import ZipfLoader
    from weft.hstu.tasks import HstuConfig, HstuStep
    from weft.pipeline import Engine, ThreadMap

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    config = HstuConfig(batch_size=4, max_seq_len=16, num_items=2000, dim=16, num_layers=1,
                        num_heads=2, head_dim=8, mlp_dim=32, num_negatives=16,
                        events_per_token=4, seed=3)
    group = torch.distributed.group.WORLD
    moved = ScheduleConfig.from_dict({"stream": {"h2d": LOADER_STREAM}})
    own_thread = ThreadMap.groups({"loader": ["h2d"]}, rest="main")
    results = []
    for variant in [StepVariant("default", "d6", "legacy"),
                    StepVariant("moved", "d6", "legacy", moved),
                    StepVariant("moved_own_thread", "d6", own_thread, moved)]:
        step = HstuStep(config, group, torch.device("cpu"))
        schedule = variant.schedule(step.bodies())
        assert schedule.task("h2d").stream == ("memcpy" if variant.config is None
                                               else LOADER_STREAM)
        with Engine(schedule, variant.thread_map, backend="host") as engine:
            losses = drain(engine, ZipfLoader(6))
        results.append((variant.name, losses, step.parameters()))
    _, losses, params = results[0]
    assert len(losses) == 6
    for name, got, got_params in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, losses)), name
        assert all(torch.equal(got_params[k], params[k]) for k in params), name


@pytest.mark.timeout(120)
def test_a_config_moving_h2d_gives_the_default_maps_bits(tmp_path):
    pytest.importorskip("torch")
    from conftest import run_ranks
    run_ranks(check_moved_h2d, 1, tmp_path / "store", timeout_s=100)


@pytest.mark.timeout(60)
def test_the_suggestion_for_fixed_costs_is_deterministic_and_beats_every_variant(tmp_path):
    a, b = suggest_variant(HOST_BOUND_COSTS), suggest_variant(HOST_BOUND_COSTS)
    assert a.suggestion.config.to_json() == b.suggestion.config.to_json()
    assert str(a.result) == str(b.result)
    assert a.variant.name == "suggested"
    # h2d's 9 ms of host work leaves the thread and the stream start_shuffle is on.
    config = a.suggestion.config
    assert config.stream == {"h2d": LOADER_STREAM}
    thread_of = {p.task: p.thread for p in a.suggestion.placement}
    assert thread_of["h2d"] != thread_of["start_shuffle"]
    assert a.suggestion.num_threads <= 4
    assert predicted_ms(a.variant, HOST_BOUND_COSTS) == a.suggestion.step_us / 1e3
    assert all(a.suggestion.step_us / 1e3 <= predicted_ms(v, HOST_BOUND_COSTS)
               for v in step_variants())
    # Written and read back, it is the same variant, named for its file.
    path = tmp_path / "host_bound_pick.json"
    a.suggestion.write_config(path)
    again = variant_from_config(path)
    assert again.name == "host_bound_pick" and again.config == config
    assert predicted_ms(again, HOST_BOUND_COSTS) == a.suggestion.step_us / 1e3


@pytest.mark.timeout(60)
def test_configs_that_name_no_variant_are_refused(tmp_path):
    lookaheads_only = tmp_path / "lookaheads.json"
    lookaheads_only.write_text(json.dumps({"lookahead": {"h2d": 4}}))
    with pytest.raises(weft.Error, match="no \"thread_map\""):
        variant_from_config(lookaheads_only)
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps({"thread_map": "legacy", "stream": {"backward": "memcpy"}}))
    with pytest.raises(weft.Error, match=r"\$\.stream\.backward: task 'backward' cannot move"):
        variant_from_config(fixed)
    assert error_pct(11.0, 10.0) == pytest.approx(10.0)
    assert error_pct(9.0, 10.0) == pytest.approx(-10.0)


@pytest.mark.timeout(60)
def test_the_fit_recovers_a_calibration_that_explains_the_steps():
    variants = step_variants()
    truth = Calibration(200.0, "all")
    measured = {v.name: predicted_ms(v, HOST_BOUND_COSTS, truth) for v in variants}
    assert rms_error_pct(measured, variants, HOST_BOUND_COSTS) > 5  # the raw model misses
    fit = fit_calibration(measured, variants, HOST_BOUND_COSTS)
    assert fit.rms_error_pct == 0 and fit.gil == "all"
    assert rms_error_pct(measured, variants, HOST_BOUND_COSTS, fit) == 0
    assert fit == fit_calibration(measured, variants, HOST_BOUND_COSTS)
    # Steps the raw model predicts exactly: nothing is added.
    exact = {v.name: predicted_ms(v, HOST_BOUND_COSTS) for v in variants}
    assert fit_calibration(exact, variants, HOST_BOUND_COSTS)[:2] == (0.0, None)
    # The suggestion under a calibration is the best under it, and deterministic.
    a, b = (suggest_variant(HOST_BOUND_COSTS, calibration=truth) for _ in range(2))
    assert a.suggestion.config == b.suggestion.config
    assert predicted_ms(a.variant, HOST_BOUND_COSTS, truth) == a.suggestion.step_us / 1e3
    with pytest.raises(weft.Error, match="no measured step"):
        fit_calibration({"ghost": 1.0}, variants, HOST_BOUND_COSTS)


TINY = ["--device", "cpu", "--warmup", "1", "--iters", "3", "--repeats", "1",
        "--torch-threads", "1", "--batch-size", "4", "--max-seq-len", "16", "--num-items", "2000",
        "--dim", "16", "--num-layers", "1", "--num-heads", "2", "--head-dim", "8",
        "--mlp-dim", "32", "--num-negatives", "16", "--events-per-token", "4"]


@pytest.mark.timeout(60)
def test_measured_costs_charge_wait_input_dist_its_busy_time_not_the_wait_behind_backward():
    # The pattern of a GPU-bound traced run: wait_input_dist's all-to-alls, enqueued after the
    # previous progress's backward (a collective, its all-to-all last), run only once backward's
    # GPU work ended; the span on data_dist holds that wait.
    pytest.importorskip("torch")
    from types import SimpleNamespace
    from weft.hstu.step import measured_costs
    schedule = step_schedule(cascade="d3")
    names = [t.name for t in schedule.tasks]
    streams = ["default", "memcpy", "data_dist", "prefetch", LOADER_STREAM]
    task, stream = names.index, streams.index

    def host(name, batch, iteration, begin_us, ticket):
        return SimpleNamespace(task=task(name), batch=batch, iteration=iteration, ticket=ticket,
                               begin_us=begin_us, end_us=begin_us + 100, failed=False)

    def gpu(name, on, batch, begin_us, end_us):
        return SimpleNamespace(task=task(name), stream=stream(on), batch=batch,
                               begin_us=begin_us, end_us=end_us, failed=False)

    trace = SimpleNamespace(
        task_names=names, stream_names=streams,
        host_spans=[host("backward", 0, 0, 0, 5), host("start_input_dist", 2, 1, 1000, 3),
                    host("wait_input_dist", 2, 1, 2000, 4)],
        gpu_spans=[gpu("backward", "default", 0, 0, 60000),
                   gpu("start_input_dist", "data_dist", 2, 1000, 2000),
                   gpu("wait_input_dist", "data_dist", 2, 2000, 60050)])
    busy = measured_costs(trace, schedule)["tasks"]
    assert busy["wait_input_dist"]["gpu"] == [{"stream": "data_dist", "us": 50}]
    assert busy["start_input_dist"]["gpu"] == [{"stream": "data_dist", "us": 1000}]
    assert busy["backward"]["gpu"] == [{"stream": "default", "us": 60000}]
    spans = measured_costs(trace, schedule, gpu="span")["tasks"]
    assert spans["wait_input_dist"]["gpu"] == [{"stream": "data_dist", "us": 58050}]


def run_bench(args, timeout_s):
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(weft.__file__)))
    env["PYTHONPATH"] = package_parent + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(REPO / "bench" / "python" / "hstu_step.py"),
                           *TINY, *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def table_rows(stdout):
    """variant -> its row's fields, from the table hstu_step.py prints."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    rows = {}
    for line in lines[header + 1:]:
        if line.startswith("#"):
            break
        name = "plain loop" if line.startswith("plain loop") else line.split()[0]
        rows[name] = line[len(name):].split()
    return lines[header], rows


@pytest.mark.timeout(300)
def test_hstu_step_suggest_runs_the_suggestion_and_prints_each_error(tmp_path):
    pytest.importorskip("torch")
    run = run_bench(["--suggest", "--calibrate", "--trace-dir", str(tmp_path)], timeout_s=280)
    assert run.returncode == 0, run.stdout + run.stderr
    header, rows = table_rows(run.stdout)
    assert "planner ms" in header and "err %" in header and "fit err %" in header
    assert "# calibration, fitted on the traced runs of 10 variants: wake-up" in run.stdout
    assert "# planner error over the 11 engine rows (timed medians): rms" in run.stdout
    assert "# costs: legacy_none's traced run, GPU busy time per task: " in run.stdout
    assert list(rows)[0] == "plain loop" and list(rows)[-1] == "suggested"
    assert len(rows) == 12  # the loop, the nine variants, loader_split_d6, the suggestion
    for name, fields in rows.items():
        assert fields[-1] == "identical", name
        predicted, error, fit_predicted, fit_error = fields[-5:-1]
        if name == "plain loop":
            assert (predicted, error, fit_predicted, fit_error) == ("-",) * 4
        else:
            float(predicted), float(fit_predicted)
            assert error[0] in "+-" and fit_error[0] in "+-"
            float(error), float(fit_error)
    assert "every run bit-identical to the loop" in run.stdout
    config_path = tmp_path / "hstu_host-bound_suggested.json"
    assert f"config in {config_path}" in run.stdout
    config = ScheduleConfig.load(str(config_path))
    assert config.thread_map is not None and set(config.stream) == {"h2d"}

    # The written config reruns as a variant of its own.
    rerun = run_bench(["--variants", "legacy_none", "--schedule-config", str(config_path),
                       "--gpu-costs", "span"], timeout_s=280)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "# costs: legacy_none's traced run, GPU span time per task: " in rerun.stdout
    _, rows = table_rows(rerun.stdout)
    assert list(rows) == ["plain loop", "legacy_none", "hstu_host-bound_suggested"]
    assert rows["hstu_host-bound_suggested"][-1] == "identical"
