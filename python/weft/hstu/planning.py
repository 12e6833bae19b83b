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

Needs neither torch nor numpy.
"""

from __future__ import annotations

import math
import os
from typing import List, Mapping, NamedTuple, Optional, Sequence, Union

from .. import plan
from .._weft import Error
from ..pipeline import ScheduleConfig, ThreadMap
from .variants import MOVABLE_STREAMS, StepVariant, step_schedule, step_variants

__all__ = ["Calibration", "SEARCH_CASCADE", "Suggested", "WAKE_UP_GRID_US", "error_pct",
           "fit_calibration", "predicted_ms", "rms_error_pct", "start_maps",
           "suggest_variant", "variant_from_config"]

# The cascade whose schedule the search starts from: d6 has the larger lookaheads, and the search
# keeps every lookahead within the schedule's (d3's all lie inside d6's bounds).
SEARCH_CASCADE = "d6"

# The wake-up costs fit_calibration tries, in us.
WAKE_UP_GRID_US = tuple(range(0, 2001, 10))


class Calibration(NamedTuple):
    """What the simulator models beyond the measured costs (weft.plan.simulate's options): a
    thread's wake-up after it blocked on another thread's task, and whether every body holds the
    GIL for its whole host time ("all") or none does (None)."""

    wake_up_us: float = 0.0
    gil: Optional[str] = None
    rms_error_pct: Optional[float] = None  # of a fit, over the runs it was fitted on

    def describe(self) -> str:
        return (f"wake-up {self.wake_up_us:g} us, GIL: "
                f"{'every body holds it' if self.gil == 'all' else 'none'}")


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
    result = plan.suggest(step_schedule(cascade=SEARCH_CASCADE), costs, max_threads=max_threads,
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


def predicted_ms(variant: StepVariant, costs,
                 calibration: Optional[Calibration] = None) -> float:
    """The simulated step of ``variant`` with ``costs`` and ``calibration``, in ms."""
    return _simulated_ms(variant, variant.schedule(), costs, calibration or Calibration())


def _simulated_ms(variant: StepVariant, schedule, costs, calibration: Calibration) -> float:
    report = plan.simulate(schedule, variant.thread_map, costs, name=variant.name,
                           wake_up_us=calibration.wake_up_us, gil=calibration.gil)
    return report.timeline.step_us / 1e3


def rms_error_pct(measured_ms: Mapping[str, float], variants: Sequence[StepVariant], costs,
                  calibration: Optional[Calibration] = None) -> float:
    """The root mean square of the predictions' relative errors (%) over the ``variants`` that
    ``measured_ms`` (variant name -> measured step in ms) names; weft.Error if it names none."""
    fitted = _measured(measured_ms, variants)
    return _rms(fitted, measured_ms, _cost_model(costs, fitted), calibration or Calibration())


def fit_calibration(measured_ms: Mapping[str, float], variants: Sequence[StepVariant],
                    costs) -> Calibration:
    """The calibration under which the simulator best matches ``measured_ms`` for the
    ``variants`` it names (as rms_error_pct): the wake-up cost from WAKE_UP_GRID_US and the GIL
    (none, or every body holding it) of the least rms_error_pct; ties go to no GIL, then the
    smaller wake-up. A grid, not a solver: the simulated step is a step function of the wake-up
    cost."""
    fitted = _measured(measured_ms, variants)
    costs = _cost_model(costs, fitted)
    best = None
    for gil in (None, "all"):
        for wake_up_us in WAKE_UP_GRID_US:
            c = Calibration(float(wake_up_us), gil)
            rms = _rms(fitted, measured_ms, costs, c)
            if best is None or rms < best.rms_error_pct:
                best = c._replace(rms_error_pct=rms)
    return best


def _measured(measured_ms, variants):
    """(variant, its schedule) for each variant measured_ms names: built once, simulated often."""
    out = [(v, v.schedule()) for v in variants if v.name in measured_ms]
    if not out:
        raise Error("no measured step for any of the variants "
                    f"{[v.name for v in variants]}")
    return out


def _cost_model(costs, fitted):
    """costs as the CostModel every simulation of a fit takes (converted once, not per call)."""
    return plan._cost_model(costs, fitted[0][1])


def _rms(fitted, measured_ms, costs, calibration: Calibration) -> float:
    errors = [error_pct(_simulated_ms(v, schedule, costs, calibration), measured_ms[v.name])
              for v, schedule in fitted]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def error_pct(predicted: float, measured: float) -> float:
    """The prediction's error relative to the measured figure, in %: above 0 when it predicts
    more time than was measured."""
    return 100.0 * (predicted - measured) / measured
