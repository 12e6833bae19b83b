"""A cost model for the planner from an engine trace (weft.plan.trace_costs).

What a cost means (docs/planner.md "Costs from a trace"):

- ``host_us`` of a task: the median of its host spans (its body's wall time on its thread).
- a GPU segment ``{"stream": S, "us": X}`` of a task, with ``gpu="busy"``: the median over the
  task's runs on stream S of its **busy time** there,

      busy = end - max(begin, the latest release inside (begin, end])

  where [begin, end] is the run's GPU span (the engine's events at the body's start and end on
  its stream) and a release is the end of something the run waited for:
    * the previous GPU span on the same stream (stream order);
    * the GPU spans of its producers in ``schedule`` (slot reads and depends_on: the same batch;
      cross_iter_depends_on: the batch at its offset; same_progress_sync on the GPU side: the
      producer's run in the same progress() call, by the host spans' iterations);
    * for a collective task (its host span holds a ticket), the GPU spans of every collective
      run enqueued before it (host spans in begin order): one communicator runs its work in the
      order it was enqueued, so a collective queued behind another one's work waits for it.
  A release counts only inside the span: one at or before ``begin`` held nothing back, and one
  after ``end`` cannot have held the run (it finished first). So a run that waited for nothing
  keeps its whole span, and a run whose span is mostly a wait keeps what followed the release.
  An end inside a span by chance, without a wait, is taken for a release; the median over the
  runs keeps a few such runs from setting the figure.
- with ``gpu="span"``: the median of the spans themselves.

The busy time is what the simulator charges a stream for the task: the simulator adds the waits
it models (stream order, the producers' GPU work) itself, so a span that already holds them would
count them twice. It is a lower bound of the task's own GPU work where the task ran kernels
before the release (work overlapping the wait is not counted), and an upper bound where other
streams' kernels slowed its own (sharing the GPU's SMs is in the time, not a wait the trace
shows).

Needs neither torch nor numpy: ``trace`` is a weft.pipeline Trace or any object with its fields
(task_names, stream_names, host_spans with task, batch, iteration, ticket, begin_us, end_us,
failed; gpu_spans with task, stream, batch, begin_us, end_us, failed).
"""

from __future__ import annotations

import bisect
import math
import statistics
from typing import Dict, List, Optional, Tuple

from ._weft import Error

__all__ = ["GPU_COST_KINDS", "trace_costs"]

GPU_COST_KINDS = ("busy", "span")

# A run of a task: (task index, batch).
_Run = Tuple[int, int]


def trace_costs(trace, schedule=None, *, gpu: str = "busy") -> dict:
    """The cost model (the cost file's JSON form) a trace measures; the module's docstring says
    what each figure means. ``schedule`` (a weft.pipeline.Schedule of the traced tasks, or None)
    names the producers a run may have waited for; without it only stream order and the
    collective order count. weft.Error for an unknown ``gpu`` or a schedule task the trace
    lacks; the same trace gives the same costs."""
    if gpu not in GPU_COST_KINDS:
        raise Error(f"trace_costs: gpu is one of {GPU_COST_KINDS}, got {gpu!r}")
    names = list(trace.task_names)
    streams = list(trace.stream_names)
    gpu_spans = sorted((s for s in trace.gpu_spans if not s.failed),
                       key=lambda s: (s.begin_us, s.end_us, s.stream, s.task, s.batch))
    if gpu == "busy":
        figure = _busy_us(names, trace.host_spans, gpu_spans, schedule)
    else:
        figure = {id(s): s.end_us - s.begin_us for s in gpu_spans}
    tasks: Dict[str, dict] = {}
    for i, name in enumerate(names):
        host = [s.end_us - s.begin_us for s in trace.host_spans if s.task == i]
        if not host:
            continue
        entry = {"host_us": statistics.median(host)}
        segments = []
        for j, stream in enumerate(streams):
            us = [figure[id(s)] for s in gpu_spans if s.task == i and s.stream == j]
            if us:
                segments.append({"stream": stream, "us": statistics.median(us)})
        if segments:
            entry["gpu"] = segments
        tasks[name] = entry
    return {"default_host_us": 0, "tasks": tasks}


def _busy_us(names: List[str], host_spans, gpu_spans, schedule) -> Dict[int, float]:
    """id(GPU span) -> its busy time; gpu_spans sorted by begin."""
    ends_of: Dict[_Run, List[float]] = {}
    for s in gpu_spans:
        ends_of.setdefault((s.task, s.batch), []).append(s.end_us)
    producers = _producers(names, schedule) if schedule is not None else {}
    iteration_of = {(h.task, h.batch): h.iteration for h in host_spans}
    batch_of = {(h.task, h.iteration): h.batch for h in host_spans}
    collectives = _CollectiveOrder(host_spans, gpu_spans)
    previous_end: Dict[int, float] = {}  # stream -> end of its previous span
    out: Dict[int, float] = {}
    for s in gpu_spans:
        releases = [collectives.latest_release(s)]
        if s.stream in previous_end:
            releases.append(previous_end[s.stream])
        previous_end[s.stream] = s.end_us
        for producer, offset, same_progress in producers.get(s.task, ()):
            batch = s.batch + offset
            if same_progress:
                batch = batch_of.get((producer, iteration_of.get((s.task, s.batch))))
            releases += ends_of.get((producer, batch), [])
        inside = [r for r in releases if r is not None and s.begin_us < r <= s.end_us]
        out[id(s)] = s.end_us - max([s.begin_us] + inside)
    return out


class _CollectiveOrder:
    """The collective runs in enqueue order. The ticket order makes the host spans of collective
    runs disjoint, so their begin order is the enqueue order."""

    def __init__(self, host_spans, gpu_spans) -> None:
        runs = sorted((s.begin_us, s.iteration, s.ticket, s.task, s.batch) for s in host_spans
                      if s.ticket >= 0 and not s.failed)
        self._position = {(r[3], r[4]): k for k, r in enumerate(runs)}
        # (end, enqueue position) of every GPU span of a collective run, by end.
        self._ends = sorted((s.end_us, self._position[(s.task, s.batch)]) for s in gpu_spans
                            if (s.task, s.batch) in self._position)

    def latest_release(self, span) -> Optional[float]:
        """The latest end inside ``span``'s (begin, end] of a collective run enqueued before the
        span's run; None for a span of a run that is not collective, or when there is none."""
        k = self._position.get((span.task, span.batch))
        if k is None:
            return None
        i = bisect.bisect_right(self._ends, (span.end_us, math.inf))
        while i > 0 and self._ends[i - 1][0] > span.begin_us:
            i -= 1
            if self._ends[i][1] < k:
                return self._ends[i][0]
        return None


def _index(names: List[str], task: str, what: str) -> int:
    try:
        return names.index(task)
    except ValueError:
        raise Error(f"trace_costs: {what} '{task}' is not a task of the trace "
                    f"({', '.join(names)})") from None


def _producers(names: List[str], schedule) -> Dict[int, List[Tuple[int, int, bool]]]:
    """Per consumer task, (producer, batch offset, same_progress) for each edge whose producer's
    GPU work it waits for: a slot's writer and depends_on (offset 0), cross_iter_depends_on (its
    offset), same_progress_sync on the GPU side (the run of the same progress() call)."""
    from .pipeline import SyncSide

    writer = {slot: t.name for t in schedule.tasks for slot in t.writes}
    out: Dict[int, List[Tuple[int, int, bool]]] = {}
    for t in schedule.tasks:
        edges = [(writer[slot], 0, False) for slot in t.reads if slot in writer]
        edges += [(p, 0, False) for p in t.depends_on]
        edges += [(p, int(offset), False) for p, offset in t.cross_iter_depends_on]
        edges += [(p, 0, True) for p, side in t.same_progress_sync if side & SyncSide.GPU]
        consumer = _index(names, t.name, "schedule task")
        out[consumer] = [(_index(names, p, "producer"), offset, same) for p, offset, same in edges]
    return out
