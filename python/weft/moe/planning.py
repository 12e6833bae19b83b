"""The planner over the micro-batched MoE step (weft.moe.step): its variants (a depth of the
stage_lookaheads family, a thread map, optionally a ScheduleConfig over it), what the simulator
predicts for each against the measured step (weft.step_planning), and the schedule
weft.plan.suggest finds for a run's measured costs, kept to the layouts the step holds.
bench/python/moe_pipeline.py --suggest is the command line over it.

    traces = []                               # a PipelinedStep(..., trace=True), step by step
    for _ in range(3):
        step(x, target, lr); traces.append(step.engine.take_trace())
    costs = weft.plan.trace_costs(merged_trace(traces), step.schedule,   # per task, each layer's
                                  gpu_waits=count_waits(num_layers))     # (native dispatcher)
    threads = step.engine.threads             # the step's own map (PipelinedStep's choice)
    variants = depth_variants(num_layers, [1, 8], 4, num_threads=len(threads))
    found = suggest_variant(costs, num_layers, 4, num_slots=[8, 4],   # .variant, .step_ms
                            own_thread_map=threads)
    found.write_config("suggested.json")      # variant_from_config() reads it back
    PipelinedStep(model, slots, 4, depth=found.variant.depth, config=found.variant.config)
    ms = predicted_ms(variant, costs)         # weft.step_planning's, on MoeVariants

A micro-batch's layout of layer l lives from its dispatch_l to its dispatch_bwd_l, so a schedule
needs layouts_of(its lookaheads) layouts per layer; a step built with LayoutSlots of num_slots
runs only schedules that need no more. The search keeps to them two ways: the lookahead search
of weft.plan.suggest bounds every lookahead to [0, min(num_slots) - 1] (any combination then
needs at most min(num_slots) layouts per layer), and the depth family is simulated at every
depth whose layouts fit, under the step's maps and those the lookahead search found. A step
is one engine source of num_micro_batches batches: the simulator runs it whole, its prefill and
drain included (weft.plan.simulate's num_batches), so that a deeper schedule is weighed with its
longer fill.

Needs neither torch nor numpy.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Dict, List, NamedTuple, Optional, Sequence, Union

from .. import plan
from .._weft import Error
from ..pipeline import ScheduleConfig, ThreadMap
from ..step_planning import Calibration, calibrated_costs, predicted_ms
from .step import (layouts_of, max_depth, moe_schedule, moe_thread_map, num_layout_slots,
                   stage_lookaheads)

__all__ = ["MoeVariant", "Suggested", "check_layouts", "count_waits", "depth_variants",
           "layout_waits", "merged_trace", "suggest_variant", "variant_from_config"]


class MoeVariant(NamedTuple):
    """A depth of the stage_lookaheads family (with each dispatch a progress after its router
    where dispatch_after_router), a thread map (as weft.pipeline.Engine takes it) and,
    optionally, a ScheduleConfig applied over the depth's lookaheads (what PipelinedStep's
    ``depth``, ``thread_map``, ``config`` and ``dispatch_after_router`` take)."""

    name: str
    num_layers: int
    depth: int
    num_micro_batches: int
    thread_map: Union[str, ThreadMap, Dict[str, List[str]]]
    config: Optional[ScheduleConfig] = None
    dispatch_after_router: bool = False

    @property
    def source_batches(self) -> int:
        """A step is one engine source of a batch per micro-batch (weft.step_planning)."""
        return self.num_micro_batches

    def schedule(self, bodies=None):
        """moe_schedule of this depth with ``bodies``, the config applied."""
        schedule = moe_schedule(self.num_layers, self.depth, bodies,
                                dispatch_after_router=self.dispatch_after_router)
        if self.config is not None:
            self.config.apply(schedule)
        return schedule

    def layouts(self) -> List[int]:
        """Per layer, the layouts the variant keeps live at once (layouts_of)."""
        return layouts_of({t.name: t.lookahead for t in self.schedule().tasks}, self.num_layers)


def count_waits(num_layers: int) -> Dict[str, str]:
    """The step's host waits for GPU work, as weft.plan.trace_costs takes them (``gpu_waits``),
    with a dispatcher whose dispatch is begun in the dispatch stage and finished in the experts
    stage (NativeEpDispatcher, LayoutSlots.native_ep): experts_l's body waits for the count
    dispatch_l's kernel publishes. Costs read with them leave that wait out of experts_l's host
    time, and the simulator waits for dispatch_l's GPU work of the same micro-batch instead, so
    that a schedule is weighed by where the count is on the GPU, not by the wait of the traced
    run. (A dispatcher that waits inside its dispatch call, EpDispatcher, has no such split.)"""
    return {f"experts_{layer}": f"dispatch_{layer}" for layer in range(num_layers)}


def layout_waits(num_layers: int) -> Dict[str, str]:
    """The step's host waits for GPU work with AllToAllDispatcher (dispatch_waits_for_layout):
    dispatch_l's body waits for the sizes that layout_begin counted in dense_router_l (and
    their exchange, a small part), so for dense_router_l's GPU work of the same micro-batch.
    As count_waits: costs read with them leave the wait out of dispatch_l's host time, and the
    simulator waits where the schedule puts the router's work."""
    return {f"dispatch_{layer}": f"dense_router_{layer}" for layer in range(num_layers)}


def depth_variants(num_layers: int, depths: Sequence[int], num_micro_batches: int,
                   num_threads: int = 2, dispatch_after_router: bool = False) -> List[MoeVariant]:
    """One variant per depth, under moe_thread_map(num_layers, num_threads), named
    "d{depth}"."""
    thread_map = moe_thread_map(num_layers, num_threads)
    return [MoeVariant(f"d{d}", num_layers, d, num_micro_batches, thread_map, None,
                       dispatch_after_router) for d in depths]


def check_layouts(variant: MoeVariant, num_slots: Optional[Sequence[int]]) -> None:
    """weft.Error unless the variant's layouts fit ``num_slots`` (per layer; None: a dispatcher
    that keeps no layout, so any schedule fits)."""
    need = variant.layouts()
    if not _fits(need, num_slots):
        raise Error(f"schedule {variant.name!r} keeps {need} layouts per layer live at once; the "
                    f"step's layout slots hold {list(num_slots)} (a micro-batch's layout of "
                    f"layer l lives from dispatch_l to dispatch_bwd_l)")


class Suggested(NamedTuple):
    variant: MoeVariant               # the suggestion, runnable like any other variant
    step_ms: float                    # the step the search predicted for it
    num_threads: int
    source: str                       # "lookahead search" or "depth family d{depth}"
    num_evaluated: int                # schedules simulated, both searches
    searched: List[str]
    not_searched: List[str]
    result: Optional["plan.SuggestResult"]  # the lookahead search (None where it cannot move)

    def write_config(self, path: Union[str, os.PathLike]) -> None:
        """The suggestion's config (its thread map and every lookahead) as a file that
        variant_from_config and PipelinedStep(config=ScheduleConfig.load(path)) take."""
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            f.write(self.variant.config.to_json() + "\n")

    def describe(self) -> str:
        """What was searched and what was not, a line each."""
        return "\n".join([f"searched: {s}" for s in self.searched]
                         + [f"not searched: {s}" for s in self.not_searched])


def suggest_variant(costs, num_layers: int, num_micro_batches: int, *,
                    num_slots: Optional[Sequence[int]] = None, max_threads: int = 2,
                    calibration: Optional[Calibration] = None, min_gain_pct: float = 1.0,
                    own_thread_map=None, name: str = "suggested",
                    dispatch_after_router: bool = False) -> Suggested:
    """The best schedule for the step with ``costs`` (as weft.plan.simulate takes them) and
    ``calibration`` that keeps to ``num_slots`` layouts per layer (the step's LayoutSlots; None:
    a dispatcher that keeps no layout, any lookahead fits), at most ``max_threads`` threads.

    Two searches, the best of both (the lowest predicted step; ties to the lookahead search's
    pick, then the shallower depth, then the maps in the order below):
    - weft.plan.suggest over the depth-B schedule, B = min(max_depth, min(num_slots) - 1):
      thread maps and every lookahead in [0, B], from moe_thread_map and the presets;
    - the depth family: every depth whose layouts fit, under the step's own thread map
      (``own_thread_map``, a thread -> tasks dict, e.g. the step's ``engine.threads``; None:
      moe_thread_map's two threads), one thread (legacy)
      and each map the first search found, those of at most max_threads threads.
    The pick is the step's own schedule (the best depth under its own map) unless the lowest
    prediction is more than ``min_gain_pct`` % below it (a gain inside the model's error is no
    reason to leave the schedule the step was built with; ties go to the step's own schedule;
    0 takes any lower prediction). Where the own map has more threads than max_threads it is
    not a candidate and the lowest prediction is the pick. The same costs give the same
    suggestion; its layouts fit num_slots (check_layouts). dispatch_after_router: the depth family
    is the step's with each dispatch a progress after its router (stage_lookaheads)."""
    if not min_gain_pct >= 0:
        raise ValueError(f"min_gain_pct must be >= 0, got {min_gain_pct!r}")
    calibration = calibration or Calibration()
    apart = dispatch_after_router
    deepest = max_depth(num_layers, apart)
    bound = deepest if num_slots is None else min(deepest, min(num_slots) - 1)
    candidates = []  # (step ms, order, variant, source, under the step's own map)
    searched, not_searched = [], []
    result = None
    own = own_thread_map if own_thread_map is not None else moe_thread_map(num_layers)
    # The family's maps in the config file's JSON form, each marked whether it is the own map.
    maps = [({"groups": own}, True), ("legacy", False)]
    num_evaluated = 0
    if bound > 0 or max_threads > 1:
        result = plan.suggest(moe_schedule(num_layers, bound, dispatch_after_router=apart),
                              calibrated_costs(costs, calibration), max_threads=max_threads,
                              min_lookahead=0, max_lookahead=bound, num_best=3,
                              num_batches=num_micro_batches,
                              wake_up_us=calibration.wake_up_us, gil=calibration.gil,
                              start_maps=[ThreadMap.of(own)])
        num_evaluated += result.num_evaluated
        for k, s in enumerate(result.suggestions):
            v = _variant(name, num_layers, num_micro_batches, bound, s.config, apart)
            candidates.append((s.step_us / 1e3, (0, 0, k), v, "lookahead search", False))
            maps.append((json.loads(s.config.to_json())["thread_map"], False))
        searched.append(f"weft.plan.suggest ({result.method}, {result.num_evaluated} schedules "
                        f"simulated): thread maps of at most {max_threads} threads, every "
                        f"lookahead in [0, {bound}] (any combination keeps at most {bound + 1} "
                        "layouts per layer)")
        not_searched += result.not_searched
    maps = [(m, is_own) for m, is_own in maps if _num_threads(num_layers, m) <= max_threads]
    fitting = [d for d in range(deepest + 1)
               if _fits(num_layout_slots(num_layers, d, apart), num_slots)]
    for d in fitting:
        lookaheads = stage_lookaheads(num_layers, d, apart)
        for k, (m, is_own) in enumerate(maps):
            config = ScheduleConfig.from_dict({"thread_map": m, "lookahead": lookaheads})
            v = _variant(name, num_layers, num_micro_batches, d, config, apart)
            ms = predicted_ms(v, costs, calibration)
            candidates.append((ms, (1, d, k), v, f"depth family d{d}", is_own))
            num_evaluated += 1
    searched.append(f"the depth family (stage_lookaheads) at every depth whose layouts fit "
                    f"({', '.join(f'd{d}' for d in fitting)}), under {len(maps)} maps "
                    f"(the step's own, one thread, the lookahead search's picks; those of at "
                    f"most {max_threads} threads)")
    if bound < deepest:
        not_searched.append(f"lookaheads above {bound} other than the depth family's (the step's "
                            f"layout slots hold {list(num_slots)} layouts per layer)")
    ns = lambda c: round(c[0] * 1e6)  # noqa: E731  (predictions compared to the nanosecond)
    best = min(candidates, key=lambda c: (ns(c), c[1]))
    under_own = [c for c in candidates if c[4]]
    if under_own:
        own_best = min(under_own, key=lambda c: (ns(c), c[1]))
        if ns(best) >= ns(own_best) * (1 - min_gain_pct / 100):
            if ns(best) < ns(own_best):
                searched.append(f"kept the step's own schedule ({own_best[3]}, {own_best[0]:.3f} "
                                f"ms): the lowest prediction ({best[3]}, {best[0]:.3f} ms) is "
                                f"{100 * (1 - best[0] / own_best[0]):.2f}% below it, within "
                                f"min_gain_pct {min_gain_pct:g}%")
            best = own_best
    ms, _, variant, source, _ = best
    check_layouts(variant, num_slots)
    return Suggested(variant, ms, _num_threads(num_layers, json.loads(
        variant.config.to_json())["thread_map"]), source, num_evaluated, searched, not_searched,
        result)


def _fits(need: Sequence[int], num_slots: Optional[Sequence[int]]) -> bool:
    """Do layouts ``need`` (per layer) fit ``num_slots`` (None: any)?"""
    return num_slots is None or (len(num_slots) == len(need) and
                                 all(n <= h for n, h in zip(need, num_slots)))


def _num_threads(num_layers: int, thread_map) -> int:
    """The threads a thread map (the config file's JSON form) gives the step's tasks."""
    config = ScheduleConfig.from_dict({"thread_map": thread_map})
    report = plan.simulate(moe_schedule(num_layers, 0), config.thread_map)
    return len(report.timeline.threads)


def _variant(name: str, num_layers: int, num_micro_batches: int, depth: int,
             config: ScheduleConfig, dispatch_after_router: bool) -> MoeVariant:
    """A variant whose config holds its thread map and every lookahead."""
    return MoeVariant(name, num_layers, depth, num_micro_batches, config.thread_map, config,
                      dispatch_after_router)


def variant_from_config(path: Union[str, os.PathLike], num_layers: int, num_micro_batches: int,
                        num_slots: Optional[Sequence[int]] = None,
                        name: Optional[str] = None) -> MoeVariant:
    """The variant a schedule config file describes (a thread map and lookaheads over depth 0),
    named after the file unless ``name`` is given; weft.Error for a config without a thread map,
    a task the schedule lacks, or layouts that do not fit ``num_slots`` (check_layouts)."""
    path = os.fspath(path)
    name = name or os.path.splitext(os.path.basename(path))[0]
    config = ScheduleConfig.load(path)
    if config.thread_map is None:
        raise Error(f"schedule config {name!r}: no \"thread_map\", so it names no variant to run")
    variant = MoeVariant(name, num_layers, 0, num_micro_batches, config.thread_map, config)
    check_layouts(variant, num_slots)
    return variant


def merged_trace(traces: Sequence) -> SimpleNamespace:
    """The traces of consecutive steps of one PipelinedStep (each step a source of its own, so
    its batches and progress() iterations restart at 0) as one trace whose batches and
    iterations run on from step to step: what weft.plan.trace_costs takes, each run of a task
    then a run of its own (weft.Error for no traces, or traces of different tasks)."""
    if not traces:
        raise Error("merged_trace: no traces")
    names, streams = list(traces[0].task_names), list(traces[0].stream_names)
    host, gpu = [], []
    batch0 = iteration0 = 0
    for trace in traces:
        if list(trace.task_names) != names or list(trace.stream_names) != streams:
            raise Error("merged_trace: the traces are of different tasks or streams")
        step_host = [SimpleNamespace(task=s.task, batch=s.batch + batch0,
                                     iteration=s.iteration + iteration0, ticket=s.ticket,
                                     begin_us=s.begin_us, end_us=s.end_us, failed=s.failed)
                     for s in trace.host_spans]
        step_gpu = [SimpleNamespace(task=s.task, stream=s.stream, batch=s.batch + batch0,
                                    begin_us=s.begin_us, end_us=s.end_us, failed=s.failed)
                    for s in trace.gpu_spans]
        host += step_host
        gpu += step_gpu
        batch0 = 1 + max([s.batch for s in step_host + step_gpu], default=batch0 - 1)
        iteration0 = 1 + max([s.iteration for s in step_host], default=iteration0 - 1)
    return SimpleNamespace(task_names=names, stream_names=streams, host_spans=host,
                           gpu_spans=gpu)
