"""Events of asynchronous EP calls, with DeepEP's interface (`deep_ep.EventOverlap`).

    _, _, _, _, handle, event = buffer.dispatch(x, ..., previous_event=buffer.capture(),
                                                async_finish=True)
    independent_work()                  # overlaps the dispatch (it runs on the comm stream)
    event.current_stream_wait()         # or: with event: more_independent_work()
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


class EventHandle:
    """A CUDA event recorded on a stream (DeepEP's `EventHandle`): by default on the current
    stream at construction, as `Buffer.capture()` makes it."""

    def __init__(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream() if stream is None else stream)

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """The completion of an EP call made with `async_finish=True` (else `event` is None).

    `extra_tensors` keeps the call's inputs and outputs referenced until the wait, so that the
    caching allocator cannot hand their memory out while the comm stream still uses it (a CUDA
    graph cannot record streams on tensors, so this is how captured calls stay safe).
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Sequence[torch.Tensor]] = None) -> None:
        self.event = event
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else None

    def current_stream_wait(self) -> None:
        """Makes `torch.cuda.current_stream()` wait for the call (no host wait)."""
        assert self.event is not None, "this call was not asynchronous (async_finish=False)"
        self.event.current_stream_wait()
        self.extra_tensors = None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()
