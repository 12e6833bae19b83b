"""Layout slots: one dispatcher per MoE layer and micro-batch in flight.

weft.ep's Buffer keeps one layout in its window (its latest uncached dispatch's); a combine or a
cached dispatch of an older handle first re-runs that handle's layout (one extra dispatch). A
micro-batch's layout of layer l is used from its forward dispatch until its backward (combine_bwd
is a cached dispatch, dispatch_bwd a combine). So a step needs, per layer, one Buffer for every
micro-batch whose layout of that layer is live at once: one in the serial step (a micro-batch's
backward ends before the next one's forward), on weft.pipeline the lookahead of the layer's
dispatch task minus that of its dispatch_bwd task, plus one (num_layout_slots). Micro-batch m of
a step uses slot m % num_slots[layer].

    slots = LayoutSlots.ep(group, num_experts=128, num_slots=[3, 1], max_tokens=1024)
    slots = LayoutSlots.native_ep(group, num_experts=128, num_slots=[3, 1], max_tokens=1024)
    slots = LayoutSlots.shared(weft.moe.LocalDispatcher(128), num_layers=2)   # stateless
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence


class LayoutSlots:
    """num_slots[l] dispatchers for layer l, made by make(layer, slot)."""

    def __init__(self, make: Callable[[int, int], object], num_slots: Sequence[int]) -> None:
        if not num_slots or any(int(n) < 1 for n in num_slots):
            raise ValueError(f"num_slots needs a count >= 1 per layer, got {list(num_slots)}")
        self.num_slots: List[int] = [int(n) for n in num_slots]
        self.keeps_layouts = True  # False: any number of micro-batches may share a dispatcher
        self._dispatchers = [[make(layer, s) for s in range(n)]
                             for layer, n in enumerate(self.num_slots)]

    @classmethod
    def shared(cls, dispatcher, num_layers: int) -> "LayoutSlots":
        """One dispatcher for every layer and micro-batch: for dispatchers that keep no layout
        (LocalDispatcher, AllToAllDispatcher: their handles carry the whole layout). A
        dispatcher that keeps layouts (keeps_layouts True: EpDispatcher) is refused: micro-
        batches in flight would overwrite each other's layout."""
        if getattr(dispatcher, "keeps_layouts", True):
            raise ValueError(f"LayoutSlots.shared takes a dispatcher that keeps no layout; "
                             f"{type(dispatcher).__name__} keeps one per Buffer: use "
                             f"LayoutSlots.ep (one Buffer per live layout)")
        slots = cls(lambda layer, s: dispatcher, [1] * num_layers)
        slots.keeps_layouts = False
        return slots

    @classmethod
    def ep(cls, group, num_experts: int, num_slots: Sequence[int], *,
           max_tokens: Optional[int] = None, num_nvl_bytes: int = 0,
           timeout_s: float = 20.0) -> "LayoutSlots":
        """An EpDispatcher over its own weft.ep.Buffer for each (layer, slot). Every Buffer is
        sized for max_tokens tokens per rank (one micro-batch) or by num_nvl_bytes."""
        import weft.ep
        from .dispatchers import EpDispatcher

        def make(layer, s):
            return EpDispatcher(weft.ep.Buffer(group, num_nvl_bytes, max_tokens=max_tokens,
                                               timeout_s=timeout_s), num_experts)
        return cls(make, num_slots)

    @classmethod
    def native_ep(cls, group, num_experts: int, num_slots: Sequence[int], *, max_tokens: int,
                  timeout_s: float = 20.0) -> "LayoutSlots":
        """A NativeEpDispatcher (weft.ep's native Buffer, the dispatch's count read in the
        experts stage) for each (layer, slot), each sized for max_tokens tokens per rank (one
        micro-batch)."""
        from .dispatchers import NativeEpDispatcher

        return cls(lambda layer, s: NativeEpDispatcher(group, num_experts, max_tokens,
                                                       timeout_s=timeout_s), num_slots)

    @property
    def num_layers(self) -> int:
        return len(self.num_slots)

    def dispatchers(self) -> list:
        """Every distinct dispatcher (layer by layer, slot by slot)."""
        seen, out = set(), []
        for row in self._dispatchers:
            for d in row:
                if id(d) not in seen:
                    seen.add(id(d))
                    out.append(d)
        return out

    def dispatcher(self, layer: int, micro_batch: int):
        row = self._dispatchers[layer]
        return row[micro_batch % len(row)]

    def check(self, need: Sequence[int]) -> None:
        """ValueError unless there are at least need[l] slots for layer l."""
        if len(need) != self.num_layers or (
                self.keeps_layouts and any(h < n for h, n in zip(self.num_slots, need))):
            raise ValueError(f"the schedule keeps {list(need)} layouts per layer live at once; "
                             f"these slots hold {self.num_slots}")
