"""ThreadMap: which engine thread runs which task.

    ThreadMap.preset("full_split")                      # or just "full_split" where a map is taken
    ThreadMap.groups({"io": ["h2d"], "compute": ["forward", "backward"]})   # or that dict itself
    ThreadMap.groups({"io": ["h2d"]}, rest="compute")   # every other task on "compute"
    ThreadMap.legacy()                                  # the sequential executor (caller's thread)

Presets: legacy, default (io / compute), by_stream, per_task, io_prefetch_compute,
io_data_dist_compute, full_split (io / data_dist / prefetch / compute); they name the HSTU tasks
and put every other task on "compute". An explicit map is strict: each task once, every task
mapped (or a rest thread).
"""

from __future__ import annotations

from typing import Iterable, List, Mapping, Optional, Union

from .. import _checks, _weft

__all__ = ["ThreadMap"]

_native = _weft.pipeline


class ThreadMap:
    def __init__(self, native) -> None:
        self._native = native

    @classmethod
    def legacy(cls) -> "ThreadMap":
        return cls(_native.ThreadMap.legacy())

    @classmethod
    def by_stream(cls) -> "ThreadMap":
        return cls(_native.ThreadMap.by_stream())

    @classmethod
    def per_task(cls) -> "ThreadMap":
        return cls(_native.ThreadMap.per_task())

    @classmethod
    def preset(cls, name: str) -> "ThreadMap":
        return cls(_native.ThreadMap.preset(name))

    @classmethod
    def groups(cls, groups: Mapping[str, Iterable[str]], rest: Optional[str] = None) -> "ThreadMap":
        pairs = []
        for thread, tasks in groups.items():
            _checks.name(thread, "thread name")
            if isinstance(tasks, str):
                raise TypeError(f"thread {thread!r}: the tasks are a list of names, got the "
                                f"string {tasks!r}")
            tasks = list(tasks)
            for t in tasks:
                if not isinstance(t, str):
                    raise TypeError(f"thread {thread!r}: task names are str, got "
                                    f"{type(t).__name__}: {t!r}")
                _checks.name(t, f"thread {thread!r}: task name")
            pairs.append((thread, tasks))
        rest = "" if rest is None else _checks.name(rest, "rest thread name")
        return cls(_native.ThreadMap.groups(pairs, rest))

    @staticmethod
    def preset_names() -> List[str]:
        return _native.ThreadMap.preset_names()

    @classmethod
    def of(cls, value: Union["ThreadMap", str, Mapping[str, Iterable[str]]]) -> "ThreadMap":
        """A ThreadMap from a ThreadMap, a preset name or a dict thread -> task names."""
        if isinstance(value, ThreadMap):
            return value
        if isinstance(value, str):
            return cls.preset(value)
        if isinstance(value, Mapping):
            return cls.groups(value)
        raise TypeError("a thread map is a ThreadMap, a preset name or a dict, got "
                        f"{type(value).__name__}")

    @property
    def name(self) -> str:
        """The preset's name, or "explicit"."""
        return self._native.name

    def __eq__(self, other) -> bool:
        return isinstance(other, ThreadMap) and self._native == other._native

    def __repr__(self) -> str:
        if self._native.is_preset or not self._native.thread_groups:
            return f"ThreadMap.preset({self.name!r})"
        return f"ThreadMap.groups({dict(self._native.thread_groups)!r}, rest={self._native.rest!r})"
