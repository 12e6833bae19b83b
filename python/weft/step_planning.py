"""The planner against a measured training step, for any step whose variants it can simulate
(weft.hstu.planning, weft.moe.planning): what the simulator predicts for a variant, its error
against the measured step, the root mean square of the errors, and a fit of what the simulator
leaves out (a thread's wake-up cost, the GIL, a stream whose GPU work runs slower than measured
because another stream's work holds SMs it would use).

A variant is any object with ``name``, ``thread_map`` (what weft.plan.simulate takes),
``schedule()`` (its weft.pipeline Schedule; bodies are not needed) and what one measured step
is: ``source_batches`` M for a step that is one engine source of M batches (a micro-batched
step: a batch per micro-batch, then the drain), simulated as that source, its prefill and drain
included; else ``num_progress_per_step``, the steady-state progress() calls of a step of a
long-running loop (1 where a step is one progress()).

    ms = predicted_ms(variant, costs)                  # costs as weft.plan.simulate takes them
    error = error_pct(ms, measured_ms)
    fit = fit_calibration({name: measured_ms, ...}, variants, costs)
    ms = predicted_ms(variant, costs, fit)

Needs neither torch nor numpy.
"""

from __future__ import annotations

import copy
import math
from typing import Mapping, NamedTuple, Optional, Sequence, Tuple

from . import plan
from ._weft import Error

__all__ = ["Calibration", "SLOWDOWN_GRID", "WAKE_UP_GRID_US", "calibrated_costs", "error_pct",
           "fit_calibration", "predicted_ms", "rms_error_pct"]

# The wake-up costs fit_calibration tries, in us.
WAKE_UP_GRID_US = tuple(range(0, 2001, 10))

# The slowdown factors fit_calibration tries for a stream (fit_calibration's slowdown_stream).
SLOWDOWN_GRID = tuple(1 + k / 20 for k in range(21))


class Calibration(NamedTuple):
    """What the simulator models beyond the measured costs (weft.plan.simulate's options): a
    thread's wake-up after it blocked on another thread's task, and whether every body holds the
    GIL for its whole host time ("all") or none does (None); and, optionally, (stream, factor):
    every GPU segment of the costs on that stream takes factor times its measured time
    (calibrated_costs), the work of a stream that shares the SMs with another stream's."""

    wake_up_us: float = 0.0
    gil: Optional[str] = None
    rms_error_pct: Optional[float] = None  # of a fit, over the runs it was fitted on
    slowdown: Optional[Tuple[str, float]] = None

    def describe(self) -> str:
        text = (f"wake-up {self.wake_up_us:g} us, GIL: "
                f"{'every body holds it' if self.gil == 'all' else 'none'}")
        if self.slowdown is not None:
            text += f", stream {self.slowdown[0]}'s GPU work x {self.slowdown[1]:g}"
        return text


def calibrated_costs(costs, calibration: Optional[Calibration]):
    """``costs`` with the calibration's slowdown applied (the same object without one). A
    slowdown needs the costs as a dict in the cost file's form (what weft.plan.trace_costs
    gives); weft.Error otherwise."""
    if calibration is None or calibration.slowdown is None:
        return costs
    if not isinstance(costs, Mapping):
        raise Error("a calibration with a stream slowdown needs the costs as a dict in the cost "
                    f"file's form, got {type(costs).__name__}")
    stream, factor = calibration.slowdown
    out = copy.deepcopy(dict(costs))
    for task in out.get("tasks", {}).values():
        for segment in task.get("gpu", []):
            if segment["stream"] == stream:
                segment["us"] = segment["us"] * factor
    return out


def predicted_ms(variant, costs, calibration: Optional[Calibration] = None) -> float:
    """The simulated step of ``variant`` with ``costs`` and ``calibration``, in ms: its source
    of ``variant.source_batches`` batches, or else ``variant.num_progress_per_step``
    steady-state progress() calls."""
    return _simulated_ms(variant, variant.schedule(), costs, calibration or Calibration())


def _simulated_ms(variant, schedule, costs, calibration: Calibration) -> float:
    batches = getattr(variant, "source_batches", 0)
    report = plan.simulate(schedule, variant.thread_map, calibrated_costs(costs, calibration),
                           name=variant.name, num_batches=batches,
                           wake_up_us=calibration.wake_up_us, gil=calibration.gil)
    if batches:
        return report.timeline.step_us / 1e3
    return report.timeline.step_us * variant.num_progress_per_step / 1e3


def rms_error_pct(measured_ms: Mapping[str, float], variants: Sequence, costs,
                  calibration: Optional[Calibration] = None) -> float:
    """The root mean square of the predictions' relative errors (%) over the ``variants`` that
    ``measured_ms`` (variant name -> measured step in ms) names; weft.Error if it names none."""
    fitted = _measured(measured_ms, variants)
    calibration = calibration or Calibration()
    model = _cost_model(calibrated_costs(costs, calibration), fitted)
    return _rms(fitted, measured_ms, model, calibration._replace(slowdown=None))


def fit_calibration(measured_ms: Mapping[str, float], variants: Sequence, costs, *,
                    slowdown_stream: Optional[str] = None) -> Calibration:
    """The calibration under which the simulator best matches ``measured_ms`` for the
    ``variants`` it names (as rms_error_pct): the wake-up cost from WAKE_UP_GRID_US, the GIL
    (none, or every body holding it) and, with ``slowdown_stream``, that stream's slowdown from
    SLOWDOWN_GRID (costs then a dict) of the least rms_error_pct; ties go to the smaller
    slowdown, then no GIL, then the smaller wake-up. A grid, not a solver: the simulated step is
    a step function of the wake-up cost."""
    fitted = _measured(measured_ms, variants)
    factors = [None] if slowdown_stream is None else SLOWDOWN_GRID
    best = None
    for factor in factors:
        slowdown = None if factor is None else (slowdown_stream, factor)
        model = _cost_model(calibrated_costs(costs, Calibration(slowdown=slowdown)), fitted)
        for gil in (None, "all"):
            for wake_up_us in WAKE_UP_GRID_US:
                c = Calibration(float(wake_up_us), gil)
                rms = _rms(fitted, measured_ms, model, c)
                if best is None or rms < best.rms_error_pct:
                    best = c._replace(rms_error_pct=rms, slowdown=slowdown)
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
    """costs: a CostModel with the slowdown applied (calibration's own is then None)."""
    errors = [error_pct(_simulated_ms(v, schedule, costs, calibration), measured_ms[v.name])
              for v, schedule in fitted]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def error_pct(predicted: float, measured: float) -> float:
    """The prediction's error relative to the measured figure, in %: above 0 when it predicts
    more time than was measured."""
    return 100.0 * (predicted - measured) / measured
