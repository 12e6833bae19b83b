"""Tasks: one unit of a training step, declared as in the HSTU benchmark's engine.

Two forms, the same fields::

    h2d = Task.from_fn("h2d", copy_to_gpu, stream="memcpy", lookahead=1,
                       reads=["batch_cpu"], writes=["batch_gpu"])

    class Forward(Task):
        name = "forward"
        reads = ("batch_gpu",)
        writes = ("loss",)
        def init(self, ctx):          # once, on the task's engine thread, when the Engine is built
            ...
        def run(self, ctx):           # once per step in which the task is active
            ctx.set("loss", model(ctx.get("batch_gpu")))

Fields (docs/pipeline.md has the semantics): ``stream`` (default ``"default"``), ``movable_to``
(other streams of the schedule the task may run on: a ScheduleConfig's ``"stream"`` entry, as
``weft plan --suggest`` writes it, moves it there), ``lookahead``
(``la >= 0``), ``reads`` / ``writes`` (slot names), ``depends_on`` (task names, same batch),
``cross_iter_depends_on`` (``"X"`` = ``("X", -1)``, or ``("X", -N)``), ``same_progress_sync``
(``"X"``, ``("X", SyncSide.GPU)``, ``{"task": "X", "sides": "cpu"}``; default side BOTH),
``collective`` (True, or the inventory: ``CollectiveOp``\\ s or ``(kind, stream, num_bytes,
count)`` tuples; ``nccl=True`` is the HSTU benchmark's spelling of ``collective=True``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Tuple, Union

from .. import _checks, _weft
from .._weft.pipeline import MAX_LOOKAHEAD

__all__ = ["CollectiveOp", "SameProgressSyncSide", "SyncSide", "Task"]


class SyncSide(enum.IntFlag):
    """Where a same_progress_sync edge holds: CPU (the bodies are ordered), GPU (the streams'
    work is ordered), BOTH."""

    CPU = 1
    GPU = 2
    BOTH = 3


SameProgressSyncSide = SyncSide  # the HSTU benchmark's name

_SIDE_NAMES = {SyncSide.CPU: "cpu", SyncSide.GPU: "gpu", SyncSide.BOTH: "both"}
_SIDES_BY_NAME = {v: k for k, v in _SIDE_NAMES.items()}
# The bound weft::pipeline::SyncSide of each side, and back: sides cross to C++ as the enum.
_NATIVE_SIDES = {side: getattr(_weft.pipeline.SyncSide, side.name) for side in _SIDE_NAMES}
_SIDES_OF_NATIVE = {native: side for side, native in _NATIVE_SIDES.items()}


@dataclass(frozen=True)
class CollectiveOp:
    """One collective a task enqueues per run: the estimate the planner reads. ``stream`` is a
    stream of the schedule; ``count`` (calls per run) is >= 1, which the schedule checks."""

    kind: str
    stream: str
    num_bytes: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        _checks.name(self.kind, "CollectiveOp.kind")
        _checks.name(self.stream, "CollectiveOp.stream")
        _checks.integer(self.num_bytes, "CollectiveOp.num_bytes", *_checks.UINT64)
        _checks.integer(self.count, "CollectiveOp.count", *_checks.INT32)


def _names(value: Union[None, str, Iterable[str]], field: str) -> Tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    out = tuple(value)
    for v in out:
        if not isinstance(v, str):
            raise TypeError(f"{field} entries must be names (str), got {type(v).__name__}: {v!r}")
        _checks.name(v, field)
    return out


def _side(value: Any, field: str) -> SyncSide:
    if isinstance(value, str):
        if value.lower() not in _SIDES_BY_NAME:
            raise ValueError(f"{field}: side {value!r} is none of cpu, gpu, both")
        return _SIDES_BY_NAME[value.lower()]
    try:
        side = SyncSide(int(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}: side {value!r} is none of CPU, GPU, BOTH") from e
    if side not in _SIDE_NAMES:
        raise ValueError(f"{field}: side {value!r} is none of CPU, GPU, BOTH")
    return side


def _cross_iter(value) -> Tuple[Tuple[str, int], ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    out = []
    for v in value:
        if isinstance(v, str):
            out.append((_checks.name(v, "cross_iter_depends_on"), -1))
        elif isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
            offset = _checks.integer(v[1], f"cross_iter_depends_on[{v[0]}]: the offset",
                                     *_checks.INT32)
            if offset >= 0:
                raise ValueError(f"cross_iter_depends_on={v!r}: the offset must be negative")
            out.append((_checks.name(v[0], "cross_iter_depends_on"), offset))
        else:
            raise TypeError(f"cross_iter_depends_on entries are names or (name, -N), got {v!r}")
    return tuple(out)


def _syncs(value) -> Tuple[Tuple[str, SyncSide], ...]:
    if value is None:
        return ()
    if isinstance(value, (str, Mapping)) or (isinstance(value, tuple) and len(value) == 2
                                             and isinstance(value[0], str)
                                             and not isinstance(value[1], str)):
        value = (value,)
    out = []
    for v in value:
        if isinstance(v, str):
            out.append((_checks.name(v, "same_progress_sync"), SyncSide.BOTH))
        elif isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
            out.append((_checks.name(v[0], "same_progress_sync"),
                        _side(v[1], f"same_progress_sync[{v[0]}]")))
        elif isinstance(v, Mapping):
            unknown = set(v) - {"task", "name", "sides", "side"}
            if unknown:
                raise ValueError(f"same_progress_sync: unknown keys {sorted(unknown)}")
            name = v.get("task", v.get("name"))
            if not isinstance(name, str):
                raise TypeError(f"same_progress_sync: {v!r} names no task")
            side = v.get("sides", v.get("side", SyncSide.BOTH))
            out.append((_checks.name(name, "same_progress_sync"),
                        _side(side, f"same_progress_sync[{name}]")))
        else:
            raise TypeError("same_progress_sync entries are names, (name, side) or mappings, "
                            f"got {v!r}")
    return tuple(out)


def _collective(collective, nccl) -> Tuple[bool, Tuple[CollectiveOp, ...]]:
    if nccl is not None and collective is not None and bool(nccl) != bool(collective):
        raise ValueError("collective= and nccl= disagree "
                         "(nccl is the HSTU benchmark's name for collective)")
    value = collective if collective is not None else nccl
    if value is None or value is False:
        return False, ()
    if value is True:
        return True, ()
    ops = []
    for op in value:
        ops.append(op if isinstance(op, CollectiveOp) else CollectiveOp(*op))
    return True, tuple(ops)


class Task:
    """A unit of a training step: subclass it (``init`` / ``run``) or use ``Task.from_fn``."""

    name: str = ""
    stream: str = "default"
    movable_to: Tuple[str, ...] = ()
    lookahead: int = 0
    reads: Tuple[str, ...] = ()
    writes: Tuple[str, ...] = ()
    depends_on: Tuple[str, ...] = ()
    cross_iter_depends_on: Tuple[Tuple[str, int], ...] = ()
    same_progress_sync: Tuple[Tuple[str, SyncSide], ...] = ()
    collective: Any = False
    nccl: Optional[bool] = None

    def __init__(self, name: Optional[str] = None, *, stream: Optional[str] = None,
                 movable_to=None, lookahead: Optional[int] = None, reads=None, writes=None,
                 depends_on=None,
                 cross_iter_depends_on=None, same_progress_sync=None, collective=None,
                 nccl: Optional[bool] = None) -> None:
        cls = type(self)
        self.name = name if name is not None else cls.name
        if not self.name or not isinstance(self.name, str):
            raise ValueError("a Task needs a name (the name= argument or a class attribute)")
        _checks.name(self.name, "task name")
        self.stream = _checks.name(stream if stream is not None else cls.stream,
                                   f"task {self.name!r}: stream")
        self.movable_to = _names(movable_to if movable_to is not None else cls.movable_to,
                                 "movable_to")
        self.lookahead = _checks.integer(lookahead if lookahead is not None else cls.lookahead,
                                         f"task {self.name!r}: lookahead", 0, MAX_LOOKAHEAD)
        self.reads = _names(reads if reads is not None else cls.reads, "reads")
        self.writes = _names(writes if writes is not None else cls.writes, "writes")
        self.depends_on = _names(depends_on if depends_on is not None else cls.depends_on,
                                 "depends_on")
        self.cross_iter_depends_on = _cross_iter(
            cross_iter_depends_on if cross_iter_depends_on is not None
            else cls.cross_iter_depends_on)
        self.same_progress_sync = _syncs(
            same_progress_sync if same_progress_sync is not None else cls.same_progress_sync)
        if collective is None and nccl is None:
            collective, nccl = cls.collective, cls.nccl
        is_collective, inventory = _collective(collective, nccl)
        self.collective = is_collective
        self.inventory = inventory

    def init(self, ctx) -> None:
        """Runs once, on the task's engine thread, when the Engine is built."""

    def run(self, ctx) -> None:
        """Runs once per step in which the task is active; ``ctx`` is a TaskContext."""

    @classmethod
    def from_fn(cls, name: str, fn: Callable, *, init: Optional[Callable] = None,
                **fields) -> "Task":
        """A task whose body is ``fn(ctx)`` (and, if given, whose init is ``init(ctx)``)."""
        return _FnTask(name, fn, init, **fields)

    # What the engine calls: the callable itself where there is one, so that no Python frame
    # sits between the engine and the body; None where the task does nothing.
    def _body(self) -> Optional[Callable]:
        return None if type(self).run is Task.run else self.run

    def _set_same_progress_sync(self, producer: str, side: SyncSide) -> None:
        # As weft::pipeline::Task::set_same_progress_sync: re-sides an edge from `producer` in
        # place, else adds one (what a ScheduleConfig does).
        if any(p == producer for p, _ in self.same_progress_sync):
            self.same_progress_sync = tuple((p, side if p == producer else s)
                                            for p, s in self.same_progress_sync)
        else:
            self.same_progress_sync += ((producer, side),)

    def _init(self) -> Optional[Callable]:
        return None if type(self).init is Task.init else self.init

    def __repr__(self) -> str:
        return (f"Task({self.name!r}, stream={self.stream!r}, lookahead={self.lookahead}, "
                f"reads={list(self.reads)}, writes={list(self.writes)})")


class _FnTask(Task):
    def __init__(self, name, fn, init, **fields):
        super().__init__(name, **fields)
        if fn is not None and not callable(fn):
            raise TypeError(f"task {name!r}: the body must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.init_fn = init

    def run(self, ctx) -> None:
        if self.fn is not None:
            self.fn(ctx)

    def init(self, ctx) -> None:
        if self.init_fn is not None:
            self.init_fn(ctx)

    def _body(self):
        return self.fn

    def _init(self):
        return self.init_fn
