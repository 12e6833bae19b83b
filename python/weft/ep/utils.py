"""DeepEP's `deep_ep.utils`: the event types of asynchronous calls (the same classes as
weft.ep's own, so that `from deep_ep.utils import EventOverlap` and `weft.ep.EventOverlap` are
one type once weft.ep is registered as deep_ep)."""

from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
