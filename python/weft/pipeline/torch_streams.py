"""The "torch" backend's Python side: each engine stream as a torch stream, current in the body.

weft's CUDA backend makes the streams (one non-blocking CUDA stream per schedule stream, with
its priority; or the caller's torch streams, Engine(streams=...)) and the events that order
them. Each body runs with

 - its task's stream as torch's current stream: a ``torch.cuda.ExternalStream`` over the
   engine's ``cudaStream_t``, so the kernels torch launches in the body land on it, and a
   ``torch.cuda.Event`` recorded there orders against the engine's events like any other work;
 - the Engine's device (the CUDA backend selects it on the thread), and the caller's grad
   mode and CUDA autocast state as they were when the Engine was built (torch keeps them per
   thread; an engine thread would otherwise see torch's defaults); set before the body and put
   back after it, what the body changed included.

A tensor made on one stream and read on another is safe: the engine keeps a slot's value until
a fence taken after its last reader has completed on every stream, so the caching allocator
cannot hand its memory out early (docs/pipeline.md "slot value lifetime").
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

__all__ = ["TorchStreams", "stream_state_calls"]


def stream_state_calls(torch):
    """(get, put): torch's current stream of a device as its (stream_id, device_index,
    device_type) triple, and making such a triple current. These are the calls under
    torch.cuda.current_stream and torch.cuda.set_stream, without the Python layer that checks
    the device and builds a Stream object on every call: a body pays for them on the engine's
    critical path. RuntimeError where a torch lacks them (weft's supported torch versions have
    them, checked by the CPU suite under each)."""
    get = getattr(torch._C, "_cuda_getCurrentStream", None)
    put = getattr(torch._C, "_cuda_setStream", None)
    if get is None or put is None:
        raise RuntimeError(f"backend='torch' needs torch._C._cuda_getCurrentStream and "
                           f"_cuda_setStream, which torch {torch.__version__} lacks")
    return get, put


class TorchStreams:
    def __init__(self, device: Optional[int]) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("backend='torch' needs a CUDA device (torch.cuda.is_available())")
        self._torch = torch
        self._get_stream, self._put_stream = stream_state_calls(torch)
        self.device_index = torch.cuda.current_device() if device is None else int(device)
        self._streams: Dict[int, object] = {}
        self._stream_ids: Dict[int, tuple] = {}  # handle -> its stream's triple (put's arguments)
        self._grad_enabled = torch.is_grad_enabled()
        self._autocast_enabled = torch.is_autocast_enabled("cuda")
        self._autocast_dtype = torch.get_autocast_dtype("cuda")

    def adopt(self, streams) -> list:
        """(name, handle) pairs for the engine; the given torch streams stay current as themselves."""
        self._adopted = dict(streams)  # the Engine's CUDA backend borrows their handles
        out = []
        for name, stream in self._adopted.items():
            if stream.device.index != self.device_index:
                raise ValueError(f"stream {name!r} is on {stream.device}, the engine on "
                                 f"cuda:{self.device_index}")
            self._streams[stream.cuda_stream] = stream
            out.append((name, stream.cuda_stream))
        return out

    def stream(self, handle: int):
        """The torch stream over an engine stream's cudaStream_t."""
        s = self._streams.get(handle)
        if s is None:
            s = self._torch.cuda.ExternalStream(handle, device=self.device_index)
            self._streams[handle] = s
        return s

    def _ids_of(self, handle: int) -> tuple:
        """The triple of the torch stream over an engine stream (stream_state_calls' put takes)."""
        ids = self._stream_ids.get(handle)
        if ids is None:
            s = self.stream(handle)
            ids = self._stream_ids[handle] = (s.stream_id, s.device_index, s.device_type)
        return ids

    def wrap(self, task, fn: Callable) -> Callable:
        torch = self._torch
        device, grad = self.device_index, self._grad_enabled
        autocast_enabled, autocast_dtype = self._autocast_enabled, self._autocast_dtype
        ids_of, get_stream, put_stream = self._ids_of, self._get_stream, self._put_stream

        # Per task this is host time on the engine's critical path, so the state is set with
        # plain calls and put back as found (the sequential executor runs bodies on the
        # caller's thread), not with a context manager each; what a body changes itself is
        # put back too. The device needs nothing here: the engine's CUDA backend selects it on
        # the thread before any body runs. Autocast keeps its context where either side has it
        # on: leaving it clears its cache of casts.
        def body(ctx):
            prev_stream = get_stream(device)
            put_stream(*ids_of(ctx.stream_handle()))
            prev_grad = torch.is_grad_enabled()
            if prev_grad != grad:
                torch.set_grad_enabled(grad)
            try:
                if autocast_enabled or torch.is_autocast_enabled("cuda"):
                    with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_enabled):
                        fn(ctx)
                else:
                    try:
                        fn(ctx)
                    finally:  # a body that turned it on with plain calls
                        if torch.is_autocast_enabled("cuda"):
                            torch.set_autocast_enabled("cuda", False)
                            torch.clear_autocast_cache()
            finally:
                if torch.is_grad_enabled() != prev_grad:
                    torch.set_grad_enabled(prev_grad)
                put_stream(*prev_stream)

        body.__name__ = getattr(fn, "__name__", task.name)
        return body
