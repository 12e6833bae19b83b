"""The planner against a measured training step, for any step whose variants it can simulate
(weft.hstu.planning, weft.moe.planning): what the simulator predicts for a variant, its error
against the measured step, the root mean square of the errors, and a fit of what the simulator
leaves out (a thread's wake-up cost, the GIL).

A variant is any object with ``name``, ``thread_map`` (what weft.plan.simulate takes),
``schedule()`` (its weft.pipeline Schedule; bodies are not needed) and
``num_progress_per_step``: the progress() calls of one measured step (1 for a step that is one
progress(); a micro-batched step runs one per micro-batch). The predicted step is that many
steady-state progress() calls.

    ms = predicted_ms(variant, costs)                  # costs as weft.plan.simulate takes them
    error = error_pct(ms, measured_ms)
    fit = fit_calibration({name: measured_ms, ...}, variants, costs)
    ms = predicted_ms(variant, costs, fit)

Needs neither torch nor numpy.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Optional, Sequence

from . import plan
from ._weft import Error

__all__ = ["Calibration", "WAKE_UP_GRID_US", "error_pct", "fit_calibration", "predicted_ms",
           "rms_error_pct"]

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


def predicted_ms(variant, costs, calibration: Optional[Calibration] = None) -> float:
    """The simulated step of ``variant`` with ``costs`` and ``calibration``, in ms:
    ``variant.num_progress_per_step`` steady-state progress() calls."""
    return _simulated_ms(variant, variant.schedule(), costs, calibration or Calibration())


def _simulated_ms(variant, schedule, costs, calibration: Calibration) -> float:
    report = plan.simulate(schedule, variant.thread_map, costs, name=variant.name,
                           wake_up_us=calibration.wake_up_us, gil=calibration.gil)
    return report.timeline.step_us * variant.num_progress_per_step / 1e3


def rms_error_pct(measured_ms: Mapping[str, float], variants: Sequence, costs,
                  calibration: Optional[Calibration] = None) -> float:
    """The root mean square of the predictions' relative errors (%) over the ``variants`` that
    ``measured_ms`` (variant name -> measured step in ms) names; weft.Error if it names none."""
    fitted = _measured(measured_ms, variants)
    return _rms(fitted, measured_ms, _cost_model(costs, fitted), calibration or Calibration())


def fit_calibration(measured_ms: Mapping[str, float], variants: Sequence, costs) -> Calibration:
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
