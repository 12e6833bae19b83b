"""weft.plan under hostile input: a long run's trace read in time linear in its size, undecodable
bytes, NaN and infinite costs, and a report written into a folder that does not exist."""

import math
import time

import pytest

from conftest import drain

import weft
from weft import plan
from weft.pipeline import Engine, Schedule, Task

pytestmark = pytest.mark.timeout(300)


def two_threads():
    return Schedule([
        Task.from_fn("A", None, stream="s1", writes=["x"]),
        Task.from_fn("B", None, stream="s2", reads=["x"]),
    ], inputs=[])


def long_trace(path, num_steps):
    """A real engine trace: four tasks on four threads, each waiting for the one before."""
    s = Schedule([
        Task.from_fn("a", None, stream="s1", reads=["batch_cpu"], writes=["x"]),
        Task.from_fn("b", None, stream="s2", reads=["x"], writes=["y"]),
        Task.from_fn("c", None, stream="s3", reads=["y"], writes=["z"]),
        Task.from_fn("d", None, reads=["z"], writes=["step_result"]),
    ])
    engine = Engine(s, "per_task", trace=True)
    drain(engine, range(num_steps))
    engine.take_trace().write_chrome_json(str(path))
    engine.close()


# A long trace ------------------------------------------------------------------------------------

def test_reading_a_long_trace_takes_time_linear_in_its_size(tmp_path):
    """A complexity guard, not a speed target (bench/python/trace_read.py measures that against
    json.load): 4x the trace may take 4x the time, with room for noise; a quadratic reader
    takes 16x."""
    def seconds_to_read(num_steps):
        path = tmp_path / f"long{num_steps}.trace.json"
        long_trace(path, num_steps)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            plan.report_from_trace(path, tmp_path / "long.html")
            times.append(time.perf_counter() - start)
        return min(times)

    small_s, large_s = seconds_to_read(5000), seconds_to_read(20000)
    assert large_s < 2.5 * 4 * small_s + 0.05, f"{small_s:.3f} s, then {large_s:.3f} s for 4x"


# Text that is not UTF-8 --------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["trace", "costs"])
def test_invalid_utf8_in_a_file_is_a_weft_error(tmp_path, where):
    path = tmp_path / "bad.json"
    if where == "trace":
        path.write_bytes(b'{"traceEvents": [{"ph": "M", "name": "\xff\xfe"}]}')
        with pytest.raises(weft.Error, match="bad.json"):
            plan.report_from_trace(path, tmp_path / "never.html")
    else:
        path.write_bytes(b'{"tasks": {"A": {"host_us": "\xff\xfe"}}}')
        with pytest.raises(weft.Error, match="bad.json"):
            plan.simulate(two_threads(), "per_task", path)


# Costs that JSON cannot hold, or just past a limit -----------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_cost_in_a_dict_is_refused_by_name(value):
    with pytest.raises(weft.Error, match=r"\$\.tasks\.A\.host_us: expected a finite number, "
                                         f"got {value}"):
        plan.simulate(two_threads(), "per_task", {"tasks": {"A": {"host_us": value}}})


def test_a_cost_just_over_the_limit_is_reported_as_given():
    with pytest.raises(weft.Error, match=r"expected a cost <= 1e\+09 us, got 1000000001\b"):
        plan.simulate(two_threads(), "per_task", {"tasks": {"A": {"host_us": 1e9 + 1}}})


@pytest.mark.parametrize("field", ["num_steps", "max_host_runahead"])
def test_simulate_counts_are_ints_in_range(field):
    with pytest.raises(weft.Error, match=f"{field} {2**40} is outside"):
        plan.simulate("default_d3", **{field: 2**40})
    with pytest.raises(TypeError, match=f"{field} must be an int"):
        plan.simulate("default_d3", **{field: 12.0})


# A report into a missing folder ------------------------------------------------------------------

def test_a_report_into_a_missing_folder_names_the_users_path(tmp_path):
    target = tmp_path / "missing" / "report.html"
    with pytest.raises(OSError) as raised:
        plan.write_report(target, ["default_d3"])
    assert str(target) in str(raised.value)
    assert ".weft-plan-" not in str(raised.value)
