"""What the HSTU step runs under: weft.pipeline's nine HSTU variants, and loader_split_d6, which
is none of them.

In the preset, h2d shares the memcpy stream with start_shuffle, so start_shuffle waits for h2d in
every progress (stream order), and every other collective waits for start_shuffle's ticket: the
host work of h2d (here the whole collate()) delays every collective of the progress, under every
thread map. loader_split_d6 is the d6 cascade (h2d at lookahead 5, start_shuffle at 4, so no
same-batch edge between them) with h2d on a stream and a thread of its own ("loader") and the
rest as full_split: h2d then runs beside the other threads' bodies.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Union

from ..pipeline import Schedule, ThreadMap
from .schedule import hstu_schedule, hstu_variants

__all__ = ["StepVariant", "step_variants"]

LOADER_SPLIT = ThreadMap.groups(
    {"loader": ["h2d"], "io": ["start_shuffle", "finish_shuffle"],
     "data_dist": ["start_input_dist", "wait_input_dist"], "prefetch": ["prefetch_embeddings"]},
    rest="compute")


class StepVariant(NamedTuple):
    name: str
    cascade: str
    thread_map: Union[str, ThreadMap]
    h2d_stream: str = "memcpy"

    def schedule(self, bodies: Dict[str, Callable] = None) -> Schedule:
        """The HSTU schedule of this cascade with ``bodies``, h2d on ``h2d_stream``."""
        schedule = hstu_schedule(bodies, cascade=self.cascade)
        schedule.task("h2d").stream = self.h2d_stream
        return schedule


def step_variants() -> List[StepVariant]:
    """The nine HSTU variants in their order, then loader_split_d6."""
    return ([StepVariant(v.name, v.cascade, v.thread_map) for v in hstu_variants()]
            + [StepVariant("loader_split_d6", "d6", LOADER_SPLIT, "loader")])
