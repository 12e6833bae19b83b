"""Schedule: the tasks of one training step, their streams and the batch's inputs.

    schedule = Schedule([h2d, forward, backward], streams={"memcpy": 0}, inputs=["batch_cpu"])

Streams a task names but ``streams`` does not list are declared with priority 0 (``"default"``
always exists). Inputs are the slots the data iterator fills: with one input each item of the
iterator is that slot's value; with several, each item maps input name -> value. The engine
validates the schedule (``validate()`` does it now): every error is a weft.Error naming the task
and the rule, e.g. ``task 'a' reads slot 'ghost' which no task writes and is no input``.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, Optional, Union

from .. import _checks, _weft
from .task import Task, _FnTask

__all__ = ["Schedule"]

_native = _weft.pipeline


class Schedule:
    def __init__(self, tasks: Iterable[Task] = (), *,
                 streams: Union[None, Mapping[str, int], Iterable[str]] = None,
                 inputs: Iterable[str] = ("batch_cpu",)) -> None:
        self._tasks: List[Task] = []
        self._streams: Dict[str, int] = {}
        if isinstance(streams, Mapping):
            for name, priority in streams.items():
                self.add_stream(name, priority)
        elif streams is not None:
            for name in streams:
                self.add_stream(name)
        self._inputs: List[str] = []
        for slot in ([inputs] if isinstance(inputs, str) else inputs):
            self.add_input(slot)
        for task in tasks:
            self.add(task)

    def add(self, task: Task) -> "Schedule":
        if not isinstance(task, Task):
            raise TypeError(f"Schedule.add takes a Task, got {type(task).__name__}")
        self._tasks.append(task)
        return self

    def add_stream(self, name: str, priority: int = 0) -> "Schedule":
        """Declares a stream; larger priority = more urgent (0 = normal)."""
        _checks.name(name, "stream name")
        priority = _checks.integer(priority, f"stream {name!r}: priority", *_checks.INT32)
        if name != "default":
            self._streams[name] = priority
        return self

    def add_input(self, slot: str) -> "Schedule":
        self._inputs.append(_checks.name(slot, "input slot"))
        return self

    @property
    def tasks(self) -> List[Task]:
        return list(self._tasks)

    @property
    def streams(self) -> Dict[str, int]:
        """Declared streams and the ones tasks name, with their priorities."""
        out = {"default": 0, **self._streams}
        for t in self._tasks:
            out.setdefault(t.stream, 0)
        return out

    @property
    def inputs(self) -> List[str]:
        return list(self._inputs)

    def task(self, name: str) -> Task:
        for t in self._tasks:
            if t.name == name:
                return t
        raise KeyError(f"the schedule has no task {name!r}")

    def validate(self) -> None:
        """Raises weft.Error naming the task and the rule broken."""
        self._to_native(with_bodies=False).validate()

    def run_order(self) -> List[str]:
        """Task names in run order (the within-progress topological order)."""
        return self._to_native(with_bodies=False).run_order()

    def wait_edges(self, thread_map) -> List[str]:
        """Every cross-thread wait inside one progress under ``thread_map``, one line each."""
        from .thread_map import ThreadMap
        return self._to_native(with_bodies=False).wait_edges(ThreadMap.of(thread_map)._native)

    def _to_native(self, with_bodies: bool = True, wrap: Optional[Callable] = None,
                   keep: Optional[list] = None):
        """The C++ schedule: a copy of each task's bound weft::pipeline::Task; ``wrap(task, fn)``
        may replace each body and init (the torch layer makes the task's stream current around
        it). The C++ side borrows the callables: they go into ``keep``, which must outlive every
        engine built from the result."""
        native = _native.Schedule()
        for name, priority in self.streams.items():
            if name != "default":
                native.add_stream(name, priority)
        for slot in self._inputs:
            native.add_input(slot)
        for t in self._tasks:
            body = t._body() if with_bodies else None
            init = t._init() if with_bodies else None
            if wrap is not None:
                body = wrap(t, body) if body is not None else None
                init = wrap(t, init) if init is not None else None
            if keep is not None:
                keep.extend(fn for fn in (body, init) if fn is not None)
            elif body is not None or init is not None:
                raise ValueError("a schedule with bodies needs a list to keep them in")
            native.add(t._native, body, init)
        return native

    @classmethod
    def _from_native(cls, native, bodies: Mapping[str, Callable]) -> "Schedule":
        """The schedule over a copy of each of ``native``'s tasks, with these bodies."""
        return cls([_FnTask._of_native(t, bodies.get(t.name)) for t in native.tasks],
                   streams=dict(native.streams), inputs=native.inputs)

    def __repr__(self) -> str:
        return f"Schedule({[t.name for t in self._tasks]}, inputs={self._inputs})"
