"""ScheduleConfig: the JSON file that tunes a schedule without code changes (docs/pipeline.md).

    config = ScheduleConfig.load("hstu.json")   # or .parse(text), .from_dict({...})
    config.apply(schedule)                      # lookaheads, stream moves, sync edges, in place
    engine = Engine(schedule, config.thread_map or "legacy")

Errors are weft.Error starting with the JSON path: ``$.lookahead.ghost: the schedule has no
task 'ghost'``.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .. import _checks, _weft
from .schedule import Schedule
from .task import SyncSide, _SIDES_OF_NATIVE
from .thread_map import ThreadMap

__all__ = ["ScheduleConfig"]


class ScheduleConfig:
    def __init__(self, native) -> None:
        self._native = native

    @classmethod
    def parse(cls, text: str) -> "ScheduleConfig":
        return cls(_weft.pipeline.ScheduleConfig.parse(_checks.name(text, "the config's text")))

    @classmethod
    def load(cls, path: str) -> "ScheduleConfig":
        return cls(_weft.pipeline.ScheduleConfig.load(str(path)))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "ScheduleConfig":
        return cls.parse(json.dumps(config))

    def to_json(self) -> str:
        """JSON that parse() reads back to an equal config."""
        return self._native.to_json()

    @property
    def thread_map(self) -> Optional[ThreadMap]:
        native = self._native.thread_map
        return None if native is None else ThreadMap(native)

    @property
    def lookahead(self) -> Dict[str, int]:
        return dict(self._native.lookahead)

    @property
    def stream(self) -> Dict[str, str]:
        """task -> the stream the config runs it on (only tasks declared ``movable_to``)."""
        return dict(self._native.stream)

    @property
    def same_progress_sync(self) -> List[Tuple[str, str, SyncSide]]:
        """(producer, consumer, side) edges the config adds or changes."""
        return [(p, c, _SIDES_OF_NATIVE[side]) for p, c, side in self._native.same_progress_sync]

    def apply(self, schedule: Schedule) -> None:
        """Overrides lookaheads, moves tasks to their configured streams and adds (or re-sides)
        same_progress_sync edges, in place; changes nothing when the config names a task the
        schedule lacks or moves a task onto a stream it may not run on (weft.Error with its JSON
        path). ScheduleConfig::apply does it, on the tasks' C++ objects."""
        self._native.apply([t._native for t in schedule.tasks])

    def __eq__(self, other) -> bool:
        return isinstance(other, ScheduleConfig) and self._native == other._native
