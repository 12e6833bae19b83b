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

A Task holds a bound weft::pipeline::Task, which holds and checks every field: a value of the
wrong type is a TypeError, one C++ refuses a weft.Error (a lookahead out of range, a cross_iter
offset >= 0), each naming the task and the field, raised where the value is given. The Python side
keeps what C++ cannot: the body and init callables, a subclass's class attributes as its
defaults, and the Python spellings above. Fields may be assigned after construction
(``schedule.task("h2d").lookahead = 5``), checked the same way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple, Union

from .. import _checks, _weft

__all__ = ["CollectiveOp", "SameProgressSyncSide", "SyncSide", "Task"]

_native = _weft.pipeline


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
_NATIVE_SIDES = {side: getattr(_native.SyncSide, side.name) for side in _SIDE_NAMES}
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


# The Python spellings of the fields, as the lists the bound Task takes; the entries' types and
# values are the bound Task's to check.

def _names(value: Union[None, str, Iterable[str]]) -> List[Any]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


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


def _cross_iter(value, task: str) -> List[Tuple[Any, Any]]:
    out = []
    for v in ([value] if isinstance(value, str) else value or ()):
        if isinstance(v, str):
            out.append((v, -1))
        elif isinstance(v, tuple) and len(v) == 2:
            out.append(v)
        else:
            raise TypeError(f"task {task!r}: cross_iter_depends_on entries are names or "
                            f"(name, -N), got {v!r}")
    return out


def _syncs(value, task: str) -> List[Tuple[Any, SyncSide]]:
    if isinstance(value, (str, Mapping)) or (isinstance(value, tuple) and len(value) == 2
                                             and isinstance(value[0], str)
                                             and not isinstance(value[1], str)):
        value = (value,)
    field = f"task {task!r}: same_progress_sync"
    out = []
    for v in value or ():
        if isinstance(v, str):
            out.append((v, SyncSide.BOTH))
        elif isinstance(v, tuple) and len(v) == 2:
            out.append((v[0], _side(v[1], f"{field}[{v[0]}]")))
        elif isinstance(v, Mapping):
            unknown = set(v) - {"task", "name", "sides", "side"}
            if unknown:
                raise ValueError(f"{field}: unknown keys {sorted(unknown)}")
            name = v.get("task", v.get("name"))
            if name is None:
                raise TypeError(f"{field}: {v!r} names no task")
            out.append((name, _side(v.get("sides", v.get("side", SyncSide.BOTH)),
                                    f"{field}[{name}]")))
        else:
            raise TypeError(f"{field} entries are names, (name, side) or mappings, got {v!r}")
    return out


def _collective(collective, nccl) -> Tuple[bool, Tuple[CollectiveOp, ...]]:
    if nccl is not None and collective is not None and bool(nccl) != bool(collective):
        raise ValueError("collective= and nccl= disagree "
                         "(nccl is the HSTU benchmark's name for collective)")
    value = collective if collective is not None else nccl
    if value is None or value is False:
        return False, ()
    if value is True:
        return True, ()
    return True, tuple(op if isinstance(op, CollectiveOp) else CollectiveOp(*op) for op in value)


def _build(name: str, stream, movable_to, lookahead, reads, writes, depends_on,
           cross_iter_depends_on, same_progress_sync, collective, nccl=None):
    """The bound weft::pipeline::Task of these fields (given in their Python spellings)."""
    task = _native.Task(name)
    task.stream = stream
    task.movable_to = _names(movable_to)
    task.lookahead = lookahead
    task.add_reads(_names(reads))
    task.add_writes(_names(writes))
    task.add_depends_on(_names(depends_on))
    for producer, offset in _cross_iter(cross_iter_depends_on, name):
        task.add_cross_iter_depends_on(producer, offset)
    for producer, side in _syncs(same_progress_sync, name):
        task.add_same_progress_sync(producer, _NATIVE_SIDES[side])
    is_collective, inventory = _collective(collective, nccl)
    if is_collective:
        task.set_collective([(op.kind, op.stream, op.num_bytes, op.count) for op in inventory])
    return task


# The fields _build takes after the name: what rebuilding a task carries over.
_FIELDS = ("stream", "movable_to", "lookahead", "reads", "writes", "depends_on",
           "cross_iter_depends_on", "same_progress_sync", "collective")


def _native_field(field: str, to_native: Callable, doc: str) -> property:
    # A field the bound Task sets in place (and checks, naming the task and the field).
    def read(self):
        value = getattr(self._native, field)
        return tuple(value) if isinstance(value, list) else value

    return property(read, lambda self, value: setattr(self._native, field, to_native(value)),
                    doc=doc)


def _edge_field(field: str, read: Callable, doc: str) -> property:
    # A C++ Task's edge lists only grow: assigning one builds the task again, the other fields
    # kept.
    return property(lambda self: read(self._native),
                    lambda self, value: self._rebuild(**{field: value}), doc=doc)


class Task:
    """A unit of a training step: subclass it (``init`` / ``run``) or use ``Task.from_fn``."""

    # A subclass's class attributes of these names; __init_subclass__ moves its own there (else
    # they would hide the properties below).
    _defaults = {"name": None, "stream": "default", "movable_to": (), "lookahead": 0,
                 "reads": (), "writes": (), "depends_on": (), "cross_iter_depends_on": (),
                 "same_progress_sync": (), "collective": False, "nccl": None}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = {f: cls.__dict__[f] for f in cls._defaults
               if f in cls.__dict__ and not isinstance(cls.__dict__[f], property)}
        for f in own:
            delattr(cls, f)
        cls._defaults = {**cls._defaults, **own}

    def __init__(self, name: Optional[str] = None, *, stream: Optional[str] = None,
                 movable_to=None, lookahead: Optional[int] = None, reads=None, writes=None,
                 depends_on=None, cross_iter_depends_on=None, same_progress_sync=None,
                 collective=None, nccl: Optional[bool] = None) -> None:
        given = dict(stream=stream, movable_to=movable_to, lookahead=lookahead, reads=reads,
                     writes=writes, depends_on=depends_on,
                     cross_iter_depends_on=cross_iter_depends_on,
                     same_progress_sync=same_progress_sync)
        fields = {f: self._defaults[f] if v is None else v for f, v in given.items()}
        if collective is None and nccl is None:
            collective, nccl = self._defaults["collective"], self._defaults["nccl"]
        name = self._defaults["name"] if name is None else name
        if not name:
            raise ValueError("a Task needs a name (the name= argument or a class attribute)")
        self._native = _build(name, **fields, collective=collective, nccl=nccl)

    name = property(lambda self: self._native.name, doc="The task's name (fixed).")
    stream = _native_field("stream", lambda v: v, "The stream the task's GPU work goes to.")
    movable_to = _native_field("movable_to", _names,
                               "Other streams of the schedule the task may run on.")
    lookahead = _native_field("lookahead", lambda v: v,
                              "How many steps ahead of the la = 0 tasks the task works.")
    reads = _edge_field("reads", lambda t: tuple(t.reads), "Slots of its batch the task reads.")
    writes = _edge_field("writes", lambda t: tuple(t.writes),
                         "Slots of its batch the task writes.")
    depends_on = _edge_field("depends_on", lambda t: tuple(t.depends_on),
                             "Producers of the same batch, without a slot.")
    cross_iter_depends_on = _edge_field(
        "cross_iter_depends_on", lambda t: tuple(t.cross_iter_depends_on),
        "(producer, offset < 0) pairs: producers of an older batch.")
    same_progress_sync = _edge_field(
        "same_progress_sync",
        lambda t: tuple((p, _SIDES_OF_NATIVE[side]) for p, side in t.same_progress_sync),
        "(producer, SyncSide) pairs: producers that run in the same progress() call.")
    collective = _edge_field("collective", lambda t: t.collective,
                             "Whether the task enqueues collectives (assign True, False or an "
                             "inventory).")

    @property
    def inventory(self) -> Tuple[CollectiveOp, ...]:
        """The collectives the task declares it enqueues per run."""
        return tuple(CollectiveOp(*op) for op in self._native.inventory)

    def _rebuild(self, **changes) -> None:
        fields = {f: getattr(self, f) for f in _FIELDS}
        fields["collective"] = self.inventory or self.collective
        fields.update(changes)
        self._native = _build(self.name, **fields)

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

    def _init(self) -> Optional[Callable]:
        return None if type(self).init is Task.init else self.init

    def __repr__(self) -> str:
        return (f"Task({self.name!r}, stream={self.stream!r}, lookahead={self.lookahead}, "
                f"reads={list(self.reads)}, writes={list(self.writes)})")


class _FnTask(Task):
    def __init__(self, name, fn, init, **fields):
        super().__init__(name, **fields)
        self._set_callables(fn, init)

    @classmethod
    def _of_native(cls, native, fn: Optional[Callable]) -> "_FnTask":
        """A task over a bound weft::pipeline::Task built in C++ (a preset schedule's)."""
        task = cls.__new__(cls)
        task._native = native
        task._set_callables(fn, None)
        return task

    def _set_callables(self, fn, init) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"task {self.name!r}: the body must be callable, got "
                            f"{type(fn).__name__}")
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
