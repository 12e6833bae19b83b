"""weft.plan: weft's planner from Python (docs/planner.md; docs/python.md "weft.plan").

    from weft import plan
    v = plan.simulate("full_split_d6")                       # an HSTU variant, default costs
    v = plan.simulate(schedule, "per_task", costs={"default_host_us": 50}, num_steps=20)
    v.timeline.step_us, v.timeline.host, v.timeline.waits    # what the simulator predicts
    plan.write_report("hstu.html")                           # the page `weft plan` writes
    plan.report_from_trace("run.trace.json", "run.html")    # a real run, drawn the same way

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

__all__ = ["CostModel", "Timeline", "VariantReport", "report_from_trace", "simulate",
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
             costs: CostsLike = None, *, num_steps: int = 12, max_host_runahead: int = 2,
             name: Optional[str] = None) -> VariantReport:
    """Simulates ``num_steps`` progress() calls (>= 4; the second to last is drawn).

    schedule: a weft.pipeline.Schedule with ``thread_map`` (a ThreadMap, preset name or dict
    thread -> tasks), or an HSTU variant name ("full_split_d6") whose schedule and map are used
    (``thread_map`` then stays None). costs: a CostModel, a dict in the cost file's JSON form
    (docs/planner.md), the path of one, or None: the HSTU figures for a schedule of exactly the
    HSTU tasks, else 20 us of host time per task. max_host_runahead: progress p starts only once
    the GPU work of progress p - max_host_runahead has finished.
    """
    if isinstance(schedule, str):
        if thread_map is not None:
            raise TypeError("simulate: an HSTU variant name brings its own thread map")
        variant = schedule
    else:
        if thread_map is None:
            raise TypeError("simulate: a Schedule needs a thread_map")
        variant = (name or "custom", schedule, thread_map)
    return _simulate(_resolve(variant), costs, num_steps, max_host_runahead)


def _simulate(resolved: Tuple[str, str, Schedule, ThreadMap], costs: CostsLike, num_steps: int,
              max_host_runahead: int) -> VariantReport:
    name, cascade, schedule, thread_map = resolved
    num_steps = _checks.integer(num_steps, "num_steps", *_checks.INT32)
    max_host_runahead = _checks.integer(max_host_runahead, "max_host_runahead", *_checks.INT32)
    return _native.simulate(name, cascade, schedule._to_native(with_bodies=False),
                            thread_map._native, _cost_model(costs, schedule), num_steps,
                            max_host_runahead)


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
