"""weft.pipeline: weft's lookahead pipeline engine with Python task bodies.

    from weft.pipeline import Engine, Schedule, Task

    schedule = Schedule([
        Task.from_fn("h2d", to_device, stream="memcpy", lookahead=1,
                     reads=["batch_cpu"], writes=["batch"]),
        Task.from_fn("train", train_step, reads=["batch"], writes=["step_result"]),
    ])
    engine = Engine(schedule, "per_task")
    it = iter(loader)
    while True:
        try:
            loss = engine.progress(it)
        except StopIteration:
            break

docs/python.md ("weft.pipeline") describes the API; docs/pipeline.md the engine's semantics.
"""

from .._weft.pipeline import MAX_LOOKAHEAD, TaskContext, Trace
from .config import ScheduleConfig
from .engine import Engine
from .schedule import Schedule
from .task import CollectiveOp, SameProgressSyncSide, SyncSide, Task
from .thread_map import ThreadMap

__all__ = [
    "CollectiveOp", "Engine", "HSTU_TASK_NAMES", "HstuVariant", "MAX_LOOKAHEAD",
    "SameProgressSyncSide",
    "Schedule", "ScheduleConfig", "SyncSide", "Task", "TaskContext", "ThreadMap", "Trace",
    "hstu_schedule", "hstu_variant", "hstu_variants",
]

_HSTU_NAMES = ("HSTU_TASK_NAMES", "HstuVariant", "hstu_schedule", "hstu_variant", "hstu_variants")


def __getattr__(name):
    # The HSTU preset lives in weft.hstu (which builds on this package); weft.pipeline keeps its
    # names, looked up when first asked for.
    if name in _HSTU_NAMES:
        from .. import hstu
        return getattr(hstu, name)
    raise AttributeError(f"module 'weft.pipeline' has no attribute {name!r}")
