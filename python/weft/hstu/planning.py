"""The planner over the HSTU step: the schedule weft.plan.suggest finds for a run's measured costs,
as one more StepVariant, and what the simulator predicts for any variant, with its error against
the measured step. bench/python/hstu_step.py --suggest is the command line over it.

    costs = measured_costs(run.trace, traced.schedule())  # weft.hstu.step: a cost file's dict
    found = suggest_variant(costs)                    # .variant (a StepVariant), .suggestion
    found.suggestion.write_config("suggested.json")   # variant_from_config() reads it back
    ms = predicted_ms(variant, costs)
    error = error_pct(ms, measured_ms)
    fit = fit_calibration({name: measured_ms, ...}, variants, costs)   # a wake-up cost, the GIL
    ms = predicted_ms(variant, costs, fit); found = suggest_variant(costs, calibration=fit)

predicted_ms, error_pct, rms_error_pct, fit_calibration and Calibration are weft.step_planning's,
shared with weft.moe.planning (a StepVariant is one progress() per step). Needs neither torch nor
numpy.
"""

from __future__ import annotations

import os
from typing import List, NamedTuple, Optional, Union

from .. import plan
from ..pipeline import ScheduleConfig, ThreadMap
from ..step_planning import (WAKE_UP_GRID_US, Calibration, calibrated_costs, error_pct,
                             fit_calibration, predicted_ms, rms_error_pct)
from .variants import MOVABLE_STREAMS, StepVariant, step_schedule, step_variants

__all__ = ["Calibration", "SEARCH_CASCADE", "Suggested", "WAKE_UP_GRID_US", "error_pct",
           "fit_calibration", "predicted_ms", "rms_error_pct", "start_maps",
           "suggest_variant", "variant_from_config"]

# The cascade whose schedule the search starts from: d6 has the larger lookaheads, and the search
# keeps every lookahead within the schedule's (d3's all lie inside d6's bounds).
SEARCH_CASCADE = "d6"


class Suggested(NamedTuple):
    variant: StepVariant            # the suggestion, runnable like any other variant
    suggestion: "plan.Suggestion"   # its config and what the simulator predicts
    result: "plan.SuggestResult"    # the search that found it; str() is its table


def start_maps() -> List[ThreadMap]:
    """The maps the search starts from besides its own (legacy, by_stream, per_task): every
    variant's map (those over the thread bound are skipped by the search) and, per movable task,
    that task on a thread of its own with the rest on one."""
    maps = [ThreadMap.of(v.thread_map) for v in step_variants()]
    maps += [ThreadMap.groups({task: [task]}, rest="rest") for task in MOVABLE_STREAMS]
    return maps


def suggest_variant(costs, *, max_threads: int = 4, calibration: Optional[Calibration] = None,
                    name: str = "suggested") -> Suggested:
    """The best schedule weft.plan.suggest finds for the step with ``costs`` (as
    weft.plan.simulate takes them) and ``calibration`` (None: neither a wake-up cost nor the
    GIL): at most ``max_threads`` threads, every lookahead within [0, the SEARCH_CASCADE
    schedule's largest], the movable tasks on any of their streams.

    A move that pays only together with a change of the map (h2d to the loader stream and onto a
    thread of its own: either alone leaves start_shuffle waiting for h2d) is reached two ways:
    the local search starts from every stream assignment of the movable tasks, and start_maps()
    gives it "h2d alone on a thread", one stream step away. The same costs give the same
    suggestion."""
    calibration = calibration or Calibration()
    result = plan.suggest(step_schedule(cascade=SEARCH_CASCADE),
                          calibrated_costs(costs, calibration), max_threads=max_threads,
                          num_best=1, wake_up_us=calibration.wake_up_us, gil=calibration.gil,
                          start_maps=start_maps())
    top = result.suggestions[0]
    return Suggested(StepVariant.of_config(name, top.config, SEARCH_CASCADE), top, result)


def variant_from_config(path: Union[str, os.PathLike], name: Optional[str] = None,
                        cascade: str = SEARCH_CASCADE) -> StepVariant:
    """The variant a schedule config file describes (what Suggestion.write_config writes: a
    thread map, every lookahead, the movable tasks' streams), over ``cascade``'s schedule; its
    name defaults to the file's name without the extension. weft.Error for a config without a
    thread map, a task the schedule lacks or a move the schedule does not allow."""
    path = os.fspath(path)
    name = name or os.path.splitext(os.path.basename(path))[0]
    variant = StepVariant.of_config(name, ScheduleConfig.load(path), cascade)
    variant.schedule()  # the config's errors now, not when the variant first runs
    return variant
