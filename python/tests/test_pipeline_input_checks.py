"""weft.pipeline refuses what it would otherwise coerce, wrap or ignore: floats, strings and bools
where an integer belongs, a string where a list of names belongs, a typo'd result slot, NaN or
negative thresholds, a bad collective inventory, integers out of range, undecodable text and a
lookahead past the engine's limit."""

import math
import time

import pytest

from conftest import drain

import weft
from weft.pipeline import (CollectiveOp, Engine, Schedule, ScheduleConfig, Task, ThreadMap,
                           MAX_LOOKAHEAD)

pytestmark = pytest.mark.timeout(60)


def one_task(**fields):
    return Schedule([Task.from_fn("a", None, **fields)])


# Types, ranges, names that are no slots ----------------------------------------------------------

@pytest.mark.parametrize("value", [1.5, "2", True, 2.0])
def test_a_lookahead_that_is_not_an_int_is_refused(value):
    with pytest.raises(TypeError, match="task 'a': lookahead must be an int"):
        Task.from_fn("a", None, lookahead=value)


@pytest.mark.parametrize("value", [2.5, "1", False])
def test_a_stream_priority_that_is_not_an_int_is_refused(value):
    with pytest.raises(TypeError, match="stream 's': priority must be an int"):
        Schedule(streams={"s": value})


@pytest.mark.parametrize("offset", [-1.0, "-1", True])
def test_a_cross_iter_offset_that_is_not_an_int_is_refused(offset):
    with pytest.raises(TypeError, match="cross_iter_depends_on"):
        Task.from_fn("a", None, cross_iter_depends_on=[("b", offset)])


def test_a_thread_map_value_given_as_a_string_is_refused():
    with pytest.raises(TypeError, match="thread 'io': the tasks are a list of names, got the "
                                        "string 'ab'"):
        ThreadMap.of({"io": "ab"})
    with pytest.raises(TypeError, match="thread 'io': task names are str, got int"):
        ThreadMap.of({"io": ["a", 3]})


@pytest.mark.parametrize("thread_map", ["legacy", "per_task"])
def test_a_result_slot_no_task_writes_is_refused_at_construction(thread_map):
    # The init runs on the engine's thread, which the refusal joins.
    s = Schedule([Task.from_fn("a", None, init=lambda ctx: None, reads=["batch_cpu"],
                               writes=["step_result"])])
    with pytest.raises(weft.Error, match="result slot 'step_reslt' is no slot of the schedule"):
        Engine(s, thread_map, result="step_reslt")
    # The default result slot may be absent: progress() then returns None.
    assert drain(Engine(Schedule([Task.from_fn("a", None)]), "legacy"), [1, 2]) == [None, None]


@pytest.mark.parametrize("value", [math.nan, -1.0, -math.inf])
def test_a_nan_or_negative_stall_threshold_is_refused(value):
    with pytest.raises(weft.Error, match="stall_report_s must be a number >= 0"):
        Engine(one_task(), "legacy", stall_report_s=value)


@pytest.mark.parametrize("name,value", [("stall_report_s", "1"), ("spin_us", True),
                                        ("trace", 1), ("device", 0.5)])
def test_engine_options_of_the_wrong_type_are_refused(name, value):
    with pytest.raises(TypeError, match=name):
        Engine(one_task(), "legacy", **{name: value})


@pytest.mark.parametrize("op,message", [
    (CollectiveOp("AllReduce", "default", 8, -5), "count -5"),
    (CollectiveOp("AllReduce", "default", 8, 0), "count 0"),
    (CollectiveOp("AllReduce", "ghost", 8, 1), "stream 'ghost'"),
    (CollectiveOp("", "default", 8, 1), "no kind"),
])
def test_a_bad_collective_inventory_is_refused(op, message):
    s = one_task(collective=[op])
    with pytest.raises(weft.Error, match=f"task 'a': collective inventory.*{message}"):
        s.validate()


@pytest.mark.parametrize("fields", [dict(num_bytes=-1), dict(num_bytes=1.5),
                                    dict(count=2.0), dict(kind=3)])
def test_a_collective_op_of_the_wrong_type_or_sign_is_refused(fields):
    args = dict(kind="AllReduce", stream="default", num_bytes=8, count=1)
    args.update(fields)
    with pytest.raises((TypeError, weft.Error), match="CollectiveOp"):
        CollectiveOp(**args)


@pytest.mark.parametrize("make,field", [
    (lambda: Task.from_fn("a", None, lookahead=2**40), "task 'a': lookahead"),
    (lambda: Schedule(streams={"s": 2**40}), "stream 's': priority"),
    (lambda: Task.from_fn("a", None, cross_iter_depends_on=[("b", -2**40)]),
     "cross_iter_depends_on"),
    (lambda: CollectiveOp("AllReduce", "default", 2**70, 1), "CollectiveOp.num_bytes"),
    (lambda: CollectiveOp("AllReduce", "default", 8, 2**40), "CollectiveOp.count"),
    (lambda: Engine(one_task(), "legacy", device=2**40), "device"),
])
def test_integers_out_of_range_name_their_field(make, field):
    with pytest.raises(weft.Error, match=field.replace("(", r"\(")):
        make()


@pytest.mark.parametrize("num_bytes,error", [(-1, weft.Error), (2**64, weft.Error),
                                             (1.5, TypeError), (True, TypeError)])
def test_record_collective_refuses_a_byte_count_that_is_no_size(num_bytes, error):
    def body(ctx):
        ctx.record_collective("AllReduce", "default", num_bytes)

    engine = Engine(Schedule([Task.from_fn("a", body, collective=True)]), "legacy")
    with pytest.raises(error, match="num_bytes"):
        drain(engine, [0])


# The lookahead limit -----------------------------------------------------------------------------

@pytest.mark.parametrize("thread_map", ["legacy", "per_task"])
def test_the_largest_lookahead_prefills_fast(thread_map):
    s = Schedule([Task.from_fn("far", None, lookahead=MAX_LOOKAHEAD),
                  Task.from_fn("near", None, lookahead=0)])
    start = time.perf_counter()
    assert drain(Engine(s, thread_map), range(3)) == [None] * 3
    assert time.perf_counter() - start < 2.0


def test_one_lookahead_limit_everywhere():
    with pytest.raises(weft.Error, match=f"lookahead {MAX_LOOKAHEAD + 1}.*{MAX_LOOKAHEAD}"):
        Task.from_fn("a", None, lookahead=MAX_LOOKAHEAD + 1)
    s = Schedule([Task.from_fn("a", None)])
    with pytest.raises(weft.Error, match=f"\\$.lookahead.a.*\\[0, {MAX_LOOKAHEAD}\\]"):
        ScheduleConfig.from_dict({"lookahead": {"a": MAX_LOOKAHEAD + 1}}).apply(s)
    ScheduleConfig.from_dict({"lookahead": {"a": MAX_LOOKAHEAD}}).apply(s)
    assert s.task("a").lookahead == MAX_LOOKAHEAD


# Text that is not UTF-8 --------------------------------------------------------------------------

def test_invalid_utf8_in_a_schedule_config_file_is_a_weft_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_bytes(b'{"thread_map": "\xff\xfe"}')
    with pytest.raises(weft.Error, match="bad.json"):
        ScheduleConfig.load(path)


@pytest.mark.parametrize("make", [
    lambda: Task.from_fn("a\ud800", None),
    lambda: Task.from_fn("a", None, reads=["x\udcff"]),
    lambda: Task.from_fn("a", None, stream="s\ud800"),
    lambda: ThreadMap.of({"io\ud800": ["a"]}),
    lambda: Schedule(inputs=["b\ud800"]),
    lambda: ScheduleConfig.parse('{"thread_map": "\ud800"}'),
])
def test_a_lone_surrogate_in_a_name_is_a_weft_error(make):
    with pytest.raises(weft.Error, match="not valid UTF-8"):
        make()
