"""The HSTU preset schedule with Python bodies: the 14 tasks of the HSTU benchmark's training step.

    schedule = hstu_schedule({"forward": forward, "backward": backward}, cascade="d3")
    cascade, thread_map = hstu_variant("full_split_d6")      # ("d6", "full_split")
    engine = Engine(hstu_schedule(bodies, cascade=cascade), thread_map)

The schedule is weft::hstu::hstu_schedule (streams, slots, edges and the HSTU benchmark's
collective inventory, docs/pipeline.md "HSTU presets"); a task without a body does nothing. The
data iterator fills the input ``batch_cpu``; ``optimizer_step`` writes ``step_result``, what
``Engine.progress()`` returns.
"""

from __future__ import annotations

from typing import Callable, List, Mapping, NamedTuple, Optional

from .. import _weft
from ..pipeline.schedule import Schedule

__all__ = ["HSTU_TASK_NAMES", "HstuVariant", "hstu_schedule", "hstu_variant", "hstu_variants"]

HSTU_TASK_NAMES = tuple(_weft.hstu.hstu_task_names())


class HstuVariant(NamedTuple):
    name: str
    cascade: str      # "d3" or "d6"
    thread_map: str   # a ThreadMap preset name


def hstu_schedule(bodies: Optional[Mapping[str, Callable]] = None, *, cascade: str = "d3",
                  prefetch: bool = True) -> Schedule:
    """The HSTU schedule; ``bodies`` maps task name -> ``fn(ctx)`` (weft.Error for other names)."""
    bodies = dict(bodies or {})
    native = _weft.hstu.hstu_schedule(cascade, prefetch, list(bodies))
    return Schedule._from_native(native, bodies)


def hstu_variants() -> List[HstuVariant]:
    """The HSTU benchmark's nine variants: legacy_none, default_d3, ..., full_split_d6."""
    return [HstuVariant(*v) for v in _weft.hstu.hstu_variants()]


def hstu_variant(name: str) -> HstuVariant:
    cascade, thread_map = _weft.hstu.hstu_variant(name)
    return HstuVariant(name, cascade, thread_map)
