"""weft.plan: weft's planner from Python (docs/planner.md; docs/python.md "weft.plan").

    from weft import plan
    v = plan.simulate("full_split_d6")                       # an HSTU variant, default costs
    v = plan.simulate(schedule, "per_task", costs={"default_host_us": 50}, num_steps=20)
    v.timeline.step_us, v.timeline.host, v.timeline.waits    # what the simulator predicts
    plan.write_report("hstu.html")                           # the page `weft plan` writes
    plan.report_from_trace("run.trace.json", "run.html")    # a real run, drawn the same way
    r = plan.suggest("full_split_d6", trace="run.trace.json")  # search maps and lookaheads
    costs = plan.trace_costs(engine.take_trace(), schedule)  # per task: host span, GPU busy time
    print(r); r.suggestions[0].config.to_json()              # a ScheduleConfig to load

simulate() follows the engine's own wait rules in steady state (weft::plan::simulate); its
result is a VariantReport: name, cascade, thread_map (described), source, placement (per task:
stream, thread, lookahead, collective) and timeline (threads, streams, host and gpu spans,
waits with the rule and cause of each, host_step_us, step_us). Bad input raises weft.Error.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _checks, _weft
from .pipeline import HSTU_TASK_NAMES, Schedule, ThreadMap, hstu_schedule, hstu_variant

_native = _weft.plan

CostModel = _native.CostModel
VariantReport = _native.VariantReport
Timeline = _native.Timeline

__all__ = ["CostModel", "GPU_COST_KINDS", "Suggestion", "SuggestResult", "Timeline",
           "VariantReport", "report_from_trace", "simulate", "suggest", "trace_costs",
           "write_report"]

HSTU_TITLE = "weft plan: HSTU thread-map presets"

CostsLike = Union[None, CostModel, Mapping, str, os.PathLike]
ThreadMapLike = Union[ThreadMap, str, Mapping[str, Iterable[str]]]
# An HSTU variant name, or (name, schedule, thread map).
VariantLike = Union[str, Tuple[str, Schedule, ThreadMapLike]]


def _cost_model(costs: CostsLike, schedule: Schedule) -> CostModel:
    """None: the HSTU figures for a schedule of exactly the HSTU tasks, else CostModel() (every
    task 20 us on the host, no GPU work); a dict in the cost file's JSON form; a path to one."""
    if isinstance(costs, CostModel):
        return costs
    if costs is None:
        names = {t.name for t in schedule.tasks}
        return CostModel.hstu_defaults() if names == set(HSTU_TASK_NAMES) else CostModel()
    if isinstance(costs, Mapping):
        _check_finite(costs, "$")
        return CostModel.parse(json.dumps(costs))
    if isinstance(costs, (str, os.PathLike)):
        return CostModel.load(os.fspath(costs))
    raise TypeError("costs are a CostModel, a dict, a path or None, got "
                    f"{type(costs).__name__}")


def _check_finite(value, path: str) -> None:
    """JSON has no NaN or infinity: refused here by path, in the cost file's error form, instead
    of reaching the parser as a syntax error."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _weft.Error(f"{path}: expected a finite number, got {value}")
    if isinstance(value, Mapping):
        for key, v in value.items():
            _check_finite(v, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{path}[{i}]")


def _resolve(variant: VariantLike) -> Tuple[str, str, Schedule, ThreadMap]:
    """(name, cascade, schedule, thread map) of a variant."""
    if isinstance(variant, str):
        v = hstu_variant(variant)
        return v.name, v.cascade, hstu_schedule(cascade=v.cascade), ThreadMap.preset(v.thread_map)
    name, schedule, thread_map = variant
    if not isinstance(schedule, Schedule):
        raise TypeError(f"variant {name!r}: the schedule is a weft.pipeline.Schedule, got "
                        f"{type(schedule).__name__}")
    return name, "custom", schedule, ThreadMap.of(thread_map)


def simulate(schedule: Union[Schedule, str], thread_map: Optional[ThreadMapLike] = None,
             costs: CostsLike = None, *, num_steps: int = 12, num_batches: int = 0,
             max_host_runahead: int = 2, name: Optional[str] = None, wake_up_us: float = 0.0,
             gil: Union[None, str, Iterable[str]] = None,
             overlap_slowdown: Optional[Tuple[str, float]] = None) -> VariantReport:
    """Simulates ``num_steps`` progress() calls (>= 4; the second to last is drawn), or with
    ``num_batches`` > 0 one finite source of that many batches as the engine runs it (its
    prefill and drain; num_steps unused): the timeline then draws every internal iteration and
    its step_us is the whole source's time, to the end of its last GPU work (docs/planner.md
    "A finite source").

    schedule: a weft.pipeline.Schedule with ``thread_map`` (a ThreadMap, preset name or dict
    thread -> tasks), or an HSTU variant name ("full_split_d6") whose schedule and map are used
    (``thread_map`` then stays None). costs: a CostModel, a dict in the cost file's JSON form
    (docs/planner.md), the path of one, or None: the HSTU figures for a schedule of exactly the
    HSTU tasks, else 20 us of host time per task. max_host_runahead: progress p starts only once
    the GPU work of progress p - max_host_runahead has finished. wake_up_us, gil and
    overlap_slowdown: as suggest() takes them (a thread's wake-up cost; the tasks whose bodies
    hold the GIL; a stream's slowdown while another stream's work runs), default none.
    """
    if isinstance(schedule, str):
        if thread_map is not None:
            raise TypeError("simulate: an HSTU variant name brings its own thread map")
        variant = schedule
    else:
        if thread_map is None:
            raise TypeError("simulate: a Schedule needs a thread_map")
        variant = (name or "custom", schedule, thread_map)
    return _simulate(_resolve(variant), costs, num_steps, max_host_runahead, wake_up_us, gil,
                     num_batches, overlap_slowdown)


def _gil_tasks(gil: Union[None, str, Iterable[str]], schedule: Schedule, caller: str) -> List[str]:
    if gil is None:
        return []
    if gil == "all":
        return [t.name for t in schedule.tasks]
    if isinstance(gil, str):
        raise TypeError(f"{caller}: gil is 'all' or a list of task names, got the string {gil!r}")
    return [_checks.name(t, "gil task") for t in gil]


def _simulate(resolved: Tuple[str, str, Schedule, ThreadMap], costs: CostsLike, num_steps: int,
              max_host_runahead: int, wake_up_us: float = 0.0,
              gil: Union[None, str, Iterable[str]] = None, num_batches: int = 0,
              overlap_slowdown: Optional[Tuple[str, float]] = None) -> VariantReport:
    name, cascade, schedule, thread_map = resolved
    num_steps = _checks.integer(num_steps, "num_steps", *_checks.INT32)
    num_batches = _checks.integer(num_batches, "num_batches", *_checks.INT32)
    max_host_runahead = _checks.integer(max_host_runahead, "max_host_runahead", *_checks.INT32)
    wake_up_us = _checks.number(wake_up_us, "wake_up_us")
    return _native.simulate(name, cascade, schedule._to_native(with_bodies=False),
                            thread_map._native, _cost_model(costs, schedule), num_steps,
                            num_batches, max_host_runahead, wake_up_us,
                            _gil_tasks(gil, schedule, "simulate"),
                            *_overlap(overlap_slowdown, "simulate"))


def _overlap(overlap_slowdown: Optional[Tuple[str, float]], caller: str) -> Tuple[str, float]:
    """(slowed stream, factor) of an overlap_slowdown argument; ("", 1.0) for None."""
    if overlap_slowdown is None:
        return "", 1.0
    if not isinstance(overlap_slowdown, (tuple, list)) or len(overlap_slowdown) != 2:
        raise TypeError(f"{caller}: overlap_slowdown is (stream name, factor), got "
                        f"{overlap_slowdown!r}")
    stream, factor = overlap_slowdown
    return _checks.name(stream, "overlap_slowdown's stream"), \
        _checks.number(factor, "overlap_slowdown's factor")


def _write_page(path: Union[str, os.PathLike], text: str) -> None:
    """As `weft plan` writes its page: a regular file (or a new one) is written beside it and
    renamed into place, so a failed write leaves no page; a character device or a FIFO is written
    to. Symbolic links are followed."""
    target = os.path.realpath(os.fspath(path))
    if os.path.exists(target) and not os.path.isfile(target):
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".weft-plan-",
                                   suffix=".html")
    except OSError as e:
        # The temporary file's name means nothing to the caller; the page's path does.
        raise type(e)(e.errno, f"cannot write the report: {e.strerror}",
                      os.fspath(path)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def write_report(path: Union[str, os.PathLike], variants: Optional[Sequence[VariantLike]] = None,
                 *, costs: CostsLike = None, traces: Sequence[Union[str, os.PathLike]] = (),
                 title: Optional[str] = None, num_steps: int = 12) -> List[VariantReport]:
    """Writes the self-contained HTML page `weft plan` writes and returns its variants.

    variants: HSTU variant names and (name, schedule, thread_map) tuples, simulated with
    ``costs``; None: the nine HSTU variants, or none when ``traces`` are given. traces: Chrome
    traces of real runs (Engine(..., trace=True).take_trace().write_chrome_json(path)), drawn
    after the simulated variants. The collective inventory is the first simulated schedule's.
    title: default "weft plan: HSTU thread-map presets" when every variant is an HSTU one,
    else "weft plan".
    """
    if variants is None:
        variants = [] if traces else [v[0] for v in _weft.hstu.hstu_variants()]
    resolved = [_resolve(v) for v in variants]
    reports = [_simulate(r, costs, num_steps, 2) for r in resolved]
    reports += [_native.read_chrome_trace(os.fspath(p)) for p in traces]
    if title is None:
        all_hstu = bool(variants) and all(isinstance(v, str) for v in variants)
        title = HSTU_TITLE if all_hstu else "weft plan"
    inventory_of = resolved[0][2]._to_native(with_bodies=False) if resolved else None
    _write_page(path, _native.render_html(reports, title, inventory_of))
    return reports


def report_from_trace(trace_path: Union[str, os.PathLike], html_path: Union[str, os.PathLike], *,
                      title: str = "weft plan") -> VariantReport:
    """Draws a real run's Chrome trace (what Engine's Trace.write_chrome_json writes) into the
    report page at html_path, as `weft plan --trace` does, and returns what was read."""
    return write_report(html_path, [], traces=[trace_path], title=title)[0]


class Suggestion:
    """One schedule suggest() found: ``config`` (a weft.pipeline.ScheduleConfig: the thread map
    and every task's lookahead; ``config.apply(schedule)`` and ``Engine(schedule,
    config.thread_map)`` run it), and what the simulator predicts: step_us, host_step_us,
    num_threads, busiest_thread and its busy_us in one progress() (with num_batches, in the
    whole source), bound ("host", "stream NAME" or "GPU waits across streams (...)"), waits
    (the drawn progress()'s cross-thread waits, or every iteration's, longest first) and
    placement."""

    def __init__(self, native) -> None:
        from .pipeline import ScheduleConfig
        self.config = ScheduleConfig(native.config)
        self.step_us = native.step_us
        self.host_step_us = native.host_step_us
        self.num_threads = native.num_threads
        self.busiest_thread = native.busiest_thread
        self.busiest_thread_busy_us = native.busiest_thread_busy_us
        self.bound = native.bound
        self.waits = list(native.waits)
        self.placement = list(native.placement)

    def write_config(self, path: Union[str, os.PathLike]) -> None:
        """Writes the config as `weft plan --suggest --config-out` does."""
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            f.write(self.config.to_json() + "\n")


class SuggestResult:
    """suggest()'s result: ``suggestions`` (best first), ``start`` (the schedule as given, on
    one thread), ``method`` ("exact" or "local"), ``searched`` and ``not_searched`` (a line
    each), ``num_evaluated``, ``num_refused``; str() is the table `weft plan --suggest` prints."""

    def __init__(self, native) -> None:
        self._native = native
        self.suggestions = [Suggestion(s) for s in native.suggestions]
        self.start = Suggestion(native.start)
        self.method = native.method
        self.searched = list(native.searched)
        self.not_searched = list(native.not_searched)
        self.num_evaluated = native.num_evaluated
        self.num_refused = native.num_refused

    def __str__(self) -> str:
        return str(self._native)


GPU_COST_KINDS = ("busy", "span")


def _gpu_waits(gpu_waits: Optional[Mapping[str, str]], what: str) -> dict:
    """gpu_waits as trace_costs takes it: a dict of task names to task names."""
    if gpu_waits is not None and not isinstance(gpu_waits, Mapping):
        raise TypeError(f"{what}: gpu_waits maps task names to task names, got "
                        f"{type(gpu_waits).__name__}")
    waits = dict(gpu_waits or {})
    for task, producer in waits.items():
        if not isinstance(task, str) or not isinstance(producer, str):
            raise TypeError(f"{what}: gpu_waits maps task names to task names, got "
                            f"{task!r}: {producer!r}")
    return waits


def trace_costs(trace, schedule: Optional[Schedule] = None, *, gpu: str = "busy",
                gpu_waits: Optional[Mapping[str, str]] = None) -> dict:
    """The cost model (the cost file's JSON form) an engine trace measures, by weft's one reading
    of a trace into costs (weft::plan::trace_costs; docs/planner.md "Costs from a trace"): per
    task, ``host_us`` the median of its host spans and, per stream it ran on, a GPU segment with
    the median over its runs of their busy time there (``gpu="busy"``: the span less the waits
    inside it that the trace shows, for stream order, the producers ``schedule`` names and the
    collective order) or of the spans themselves (``gpu="span"``).

    trace: a weft.pipeline Trace, or any object with its fields (task_names, stream_names;
    host_spans with task, batch, iteration, ticket, begin_us, end_us, failed; gpu_spans with
    task, stream, batch, begin_us, end_us, failed). schedule: the traced tasks' Schedule, or None
    (then only stream order and the collective order are known). weft.Error for an unknown
    ``gpu`` or a schedule task the trace lacks; the same trace gives the same costs.

    gpu_waits: task -> the task whose GPU work of the same batch its body waits for on the host
    (e.g. a count the producer's kernel writes): such a task's ``host_us`` leaves that wait out
    (the part of each span before the producer's GPU work of its batch ended, where it ended
    inside the span) and its cost says ``"waits_for_gpu_of"``, which simulate() and suggest()
    then model as a wait for that work."""
    native_schedule = None if schedule is None else schedule._to_native(with_bodies=False)
    waits = _gpu_waits(gpu_waits, "trace_costs")
    model = json.loads(_native.trace_costs(trace, native_schedule, gpu, 0.0, waits).to_json())
    for entry in model["tasks"].values():
        if not entry["gpu"]:
            del entry["gpu"]  # the cost file's form: no "gpu" for a task without GPU work
    return model


def suggest(schedule: Union[Schedule, str] = "full_split_d6", costs: CostsLike = None, *,
            trace: Optional[Union[str, os.PathLike]] = None, max_threads: int = 4,
            min_lookahead: int = 0, max_lookahead: Optional[int] = None, num_best: int = 3,
            num_steps: int = 12, num_batches: int = 0, max_host_runahead: int = 2,
            wake_up_us: float = 0.0, gil: Union[None, str, Iterable[str]] = None,
            overlap_slowdown: Optional[Tuple[str, float]] = None,
            start_maps: Sequence[ThreadMapLike] = (),
            gpu_waits: Optional[Mapping[str, str]] = None) -> SuggestResult:
    """Searches thread maps (at most ``max_threads`` threads) and lookaheads (each task's in
    [min_lookahead, max_lookahead]; None: up to the schedule's largest) for the lowest simulated
    step, as `weft plan --suggest` does (docs/planner.md "Suggesting a schedule").

    schedule: a weft.pipeline.Schedule, or an HSTU variant name whose schedule is searched and
    whose thread map (with every preset) is a start. costs: as simulate() takes them; or
    ``trace``: a real run's Chrome trace, whose runs give the costs (trace_costs: medians, GPU
    busy time; every task of the schedule must be in it). The result is never worse than any
    start map (legacy, by_stream, per_task when it fits, start_maps) under the schedule's own
    lookaheads. wake_up_us: the simulated cost of waking a thread that blocked on another
    thread's task (0: instant; `weft plan --suggest --wake-up-us`). gil: the tasks whose bodies
    hold the GIL for their whole host time, simulated as one lock shared by every thread: "all"
    (what Python bodies do, at most), a list of task names, or None. num_batches > 0: every
    candidate simulated as one finite source of that many batches (simulate()), so that deeper
    lookaheads are weighed with their longer prefill and drain. Bad input, or a schedule the
    search cannot move (one task and fixed lookaheads), raises weft.Error. overlap_slowdown:
    (stream, factor), the stream's GPU work running factor times slower while another stream's
    work runs beside it (the SMs a concurrent kernel holds; factor in [1, 100]), or None.
    gpu_waits: with ``trace``, trace_costs's (task -> the producer whose GPU work of the same
    batch its body waits for); candidates under which such a wait could never end are refused.
    """
    maps = [ThreadMap.of(m) for m in start_maps]
    if isinstance(schedule, str):
        _, _, schedule, own = _resolve(schedule)
        maps = [own] + [ThreadMap.preset(n) for n in ThreadMap.preset_names()] + maps
    elif not isinstance(schedule, Schedule):
        raise TypeError("suggest: the schedule is a weft.pipeline.Schedule or an HSTU variant "
                        f"name, got {type(schedule).__name__}")
    if trace is not None:
        if costs is not None:
            raise TypeError("suggest: give costs or a trace, not both")
        model = _native.trace_costs(_native.read_engine_trace(os.fspath(trace)),
                                    schedule._to_native(with_bodies=False), "busy", 0.0,
                                    _gpu_waits(gpu_waits, "suggest"))
    elif gpu_waits:
        raise TypeError("suggest: gpu_waits is for the costs a trace measures (a cost model "
                        "says waits_for_gpu_of itself)")
    else:
        model = _cost_model(costs, schedule)
    args = [_checks.integer(v, n, *_checks.INT32) for v, n in (
        (max_threads, "max_threads"), (min_lookahead, "min_lookahead"),
        (-1 if max_lookahead is None else max_lookahead, "max_lookahead"),
        (num_best, "num_best"), (num_steps, "num_steps"), (num_batches, "num_batches"),
        (max_host_runahead, "max_host_runahead"))]
    wake_up_us = _checks.number(wake_up_us, "wake_up_us")
    gil_tasks = _gil_tasks(gil, schedule, "suggest")
    return SuggestResult(_native.suggest(schedule._to_native(with_bodies=False), model, *args,
                                         wake_up_us, gil_tasks,
                                         *_overlap(overlap_slowdown, "suggest"),
                                         [m._native for m in maps]))
