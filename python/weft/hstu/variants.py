"""What the HSTU step runs under: its schedule (the HSTU preset with h2d free to move to a stream
of its own), weft.pipeline's nine HSTU variants over it, and loader_split_d6, which is none of
them.

In the preset, h2d shares the memcpy stream with start_shuffle, so start_shuffle waits for h2d in
every progress (stream order), and every other collective waits for start_shuffle's ticket: the
host work of h2d (here the whole collate()) delays every collective of the progress, under every
thread map. loader_split_d6 is the d6 cascade (h2d at lookahead 5, start_shuffle at 4, so no
same-batch edge between them) with h2d moved to the "loader" stream and a thread of its own, the
rest as full_split: h2d then runs beside the other threads' bodies.

    schedule = step_schedule(step.bodies(), cascade="d6")   # h2d movable_to ["loader"]
    for v in step_variants():
        engine = Engine(v.schedule(step.bodies()), v.thread_map)
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Union

from .._weft import Error
from ..pipeline import Schedule, ScheduleConfig, ThreadMap
from .schedule import hstu_schedule, hstu_variants

__all__ = ["LOADER_STREAM", "MOVABLE_STREAMS", "StepVariant", "step_schedule", "step_variants"]

LOADER_STREAM = "loader"

# Task -> the streams besides its preset one that its body may run on. A body qualifies when it
# puts all its work on the stream the engine makes current (weft.hstu.tasks); only h2d gains from
# another one: its copies off the memcpy stream free start_shuffle from waiting on collate(). The
# collective tasks keep theirs (the collective inventory and the tickets are the preset's), and
# the compute tasks have no second stream worth running on.
MOVABLE_STREAMS: Mapping[str, List[str]] = {"h2d": [LOADER_STREAM]}

LOADER_SPLIT = ThreadMap.groups(
    {"loader": ["h2d"], "io": ["start_shuffle", "finish_shuffle"],
     "data_dist": ["start_input_dist", "wait_input_dist"], "prefetch": ["prefetch_embeddings"]},
    rest="compute")


def step_schedule(bodies: Optional[Mapping[str, Callable]] = None, *,
                  cascade: str = "d3") -> Schedule:
    """The HSTU schedule of ``cascade`` with ``bodies``, every task on its preset stream, and
    each task of MOVABLE_STREAMS declared ``movable_to`` those streams (declared here, unused
    until a ScheduleConfig moves a task there)."""
    schedule = hstu_schedule(bodies, cascade=cascade)
    for task, streams in MOVABLE_STREAMS.items():
        for stream in streams:
            schedule.add_stream(stream)
        schedule.task(task).movable_to = streams
    return schedule


class StepVariant(NamedTuple):
    """A cascade, a thread map and, optionally, a ScheduleConfig applied over the cascade's
    lookaheads (its lookaheads and stream moves; its thread map, if any, is ``thread_map``)."""

    name: str
    cascade: str
    thread_map: Union[str, ThreadMap]
    config: Optional[ScheduleConfig] = None

    num_progress_per_step = 1  # one progress() is one training step (weft.step_planning)

    def schedule(self, bodies: Dict[str, Callable] = None) -> Schedule:
        """step_schedule of this cascade with ``bodies``, the config applied."""
        schedule = step_schedule(bodies, cascade=self.cascade)
        if self.config is not None:
            self.config.apply(schedule)
        return schedule

    @classmethod
    def of_config(cls, name: str, config: ScheduleConfig, cascade: str = "d6") -> "StepVariant":
        """The variant a schedule config describes (what weft.plan.suggest writes); weft.Error
        when the config has no thread map."""
        if config.thread_map is None:
            raise Error(f"schedule config {name!r}: no \"thread_map\", so it names no variant "
                        "to run (weft.plan.suggest writes one)")
        return cls(name, cascade, config.thread_map, config)


def step_variants() -> List[StepVariant]:
    """The nine HSTU variants in their order, then loader_split_d6."""
    loader = ScheduleConfig.from_dict({"stream": {"h2d": LOADER_STREAM}})
    return ([StepVariant(v.name, v.cascade, v.thread_map) for v in hstu_variants()]
            + [StepVariant("loader_split_d6", "d6", LOADER_SPLIT, loader)])
