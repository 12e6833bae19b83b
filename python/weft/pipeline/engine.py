"""Engine: runs a Schedule over a data iterator, one training step per progress().

    engine = Engine(schedule, "full_split")            # host backend; backend="torch" on a GPU
    it = iter(loader)
    while True:
        try:
            result = engine.progress(it)               # TorchRec's TrainPipeline.progress
        except StopIteration:
            break

Semantics (docs/pipeline.md and docs/python.md "weft.pipeline"):
 - progress(data_iter) pulls batches from data_iter into the schedule's inputs and runs internal
   iterations until the la = 0 tasks finish a batch; it returns that batch's ``result`` slot
   (default ``"step_result"``; None when unset). The first call prefills, the last ones drain:
   M batches in give M results, then StopIteration (and again on every later call). A new
   iterator object starts a new source (weft.Error while batches of the old one are in flight:
   drain first, or reset()).
 - The GIL: progress() releases it while the engine runs; an engine thread holds it only while
   it runs a body, so a body that blocks without the GIL (time.sleep, a lock, a torch host sync)
   lets the others run.
 - Errors: an exception raised in a body reaches the caller of progress() as the same exception
   object, with its traceback; the other threads wake and skip the rest of the step. The engine
   then raises weft.Error until reset(). A StopIteration raised in a body arrives as a
   RuntimeError whose __cause__ it is (else it would end the caller's loop). Ctrl-C while
   progress() waits raises KeyboardInterrupt once the bodies that are running return (checked
   every 20 ms of waiting), with the engine failed as after any error; a body that never returns
   keeps progress() waiting (the stall report names it).
 - Slot values are destroyed on the caller's thread with the GIL, after the backend's streams
   have finished the work enqueued while they were live. The progress() that raises
   StopIteration does not wait for the streams: the last batches' values go in a later call
   once that work is done (progress(), a new source, synchronize()), or with the engine; a
   result read on a stream the engine does not have needs synchronize() or an event first, and
   errors of that work come from synchronize() or the next call.
 - One call at a time, from one thread at a time: a call made while another runs (from a second
   thread, from a body, or from a slot value's __del__) raises weft.Error naming both, and so
   does every call after close() ("the engine is closed") and every call in a process forked
   after the Engine was built (the child has none of its threads; build a new Engine there).
 - The garbage collector sees the data iterator and the slot values the engine holds: a cycle
   through them (a trainer whose bodies are its methods and whose source is its generator) is
   collected, which closes the engine and joins its threads.
 - Interpreter exit with a progress() running in a daemon thread: the engine's threads stop
   where they would next take the GIL, as a daemon thread does.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Union

from .. import _checks, _weft
from .schedule import Schedule
from .thread_map import ThreadMap

__all__ = ["Engine"]


class Engine:
    """``Engine(schedule, thread_map="default", *, backend="host", ...)``.

    thread_map: a ThreadMap, a preset name or a dict thread -> task names.
    backend: "host" (host streams, no GPU) or "torch" (CUDA streams on ``device``, each a
    torch.cuda.ExternalStream that is current inside its task's body; see weft.pipeline.torch).
    trace: record host spans and waits (and GPU spans on "torch"); take_trace() returns them.
    stall_report_s: a progress() that runs this long prints, once, where each thread is (0: off;
    NaN or negative: weft.Error).
    spin_us: how long a waiting engine thread spins before it sleeps (negative: the engine picks).
    result: the slot whose value progress() returns (weft.Error if the schedule has no such
    slot); by default "step_result", and None from progress() where the schedule has none.
    streams: ("torch") schedule stream name -> a torch.cuda.Stream of the caller's that the engine
    uses for it instead of making one (kept alive by the Engine; its priority is its own).
    """

    def __init__(self, schedule: Schedule,
                 thread_map: Union[ThreadMap, str, Dict[str, List[str]]] = "default", *,
                 backend: str = "host", device: Optional[int] = None, trace: bool = False,
                 stall_report_s: float = 60.0, spin_us: float = -1.0,
                 result: Optional[str] = None, streams: Optional[Dict[str, Any]] = None) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError(f"Engine takes a weft.pipeline.Schedule, got {type(schedule).__name__}")
        trace = _checks.boolean(trace, "trace")
        stall_report_s = _checks.number(stall_report_s, "stall_report_s")
        spin_us = _checks.number(spin_us, "spin_us")
        if device is not None:
            device = _checks.integer(device, "device", 0, _checks.INT32[1])
        result_slot = "step_result" if result is None else _checks.name(result, "result")
        self._schedule = schedule
        self._thread_map = ThreadMap.of(thread_map)
        wrap = None
        native_backend = backend
        adopted = []
        if backend == "torch":
            from .torch_streams import TorchStreams
            self._torch = TorchStreams(device)
            adopted = self._torch.adopt(streams or {})
            wrap = self._torch.wrap
            native_backend, device = "cuda", self._torch.device_index
        elif backend != "host":
            raise ValueError(f"unknown backend {backend!r} (host or torch)")
        elif streams:
            raise ValueError("streams= needs backend='torch'")
        # The bodies, which the C++ engine borrows; an attribute the garbage collector sees.
        self._callables: list = []
        self._engine = _weft.pipeline.Engine(
            schedule._to_native(wrap=wrap, keep=self._callables), self._thread_map._native,
            native_backend, 0 if device is None else device, adopted, trace, stall_report_s,
            spin_us, result_slot, result is not None)

    def progress(self, data_iter: Iterator) -> Any:
        """One training step: the result slot's value; StopIteration once every batch is done."""
        return self._engine.progress(data_iter)

    def reset(self) -> None:
        """Discards the batches in flight and any error; the iterator continues where it is."""
        self._engine.reset()

    def synchronize(self) -> None:
        """Waits for all stream work, then destroys the slot values whose work is done (all of
        them: after the end of data, every value the engine holds); raises the backend's first
        error."""
        self._engine.synchronize()

    def take_trace(self):
        """The recording so far (trace=True), cleared: ``.write_chrome_json(path)`` writes it for
        ui.perfetto.dev; ``.host_spans``, ``.waits``, ``.gpu_spans`` hold the records."""
        return self._engine.take_trace()

    def collective_inventory(self) -> List[dict]:
        """What collective tasks recorded (ctx.record_collective), per task and kind: dicts with
        task, kind, stream, bytes_per_call, calls_per_run."""
        return self._engine.collective_inventory()

    @property
    def schedule(self) -> Schedule:
        return self._schedule

    @property
    def threads(self) -> Dict[str, List[str]]:
        """Engine thread -> its tasks in run order (under the legacy map one entry, "main": the
        caller's thread)."""
        return dict(self._engine.threads())

    @property
    def backend(self) -> str:
        return self._engine.backend

    @property
    def failed(self) -> bool:
        return self._engine.failed

    @property
    def num_in_flight(self) -> int:
        """Batches pulled from the current iterator and not yet returned."""
        return self._engine.num_in_flight

    @property
    def last_batch_index(self) -> int:
        """The index (within its iterator) of the batch the last progress() returned."""
        return self._engine.last_batch_index

    def stream_handle(self, stream: str) -> int:
        """The backend's native stream (a cudaStream_t as an integer on "torch")."""
        return self._engine.stream_handle(stream)

    def torch_stream(self, stream: str):
        """The torch stream of a schedule stream (backend "torch"), e.g. a comm stream that a
        body uses beside its own (join it back before the body returns)."""
        if self.backend != "cuda":
            raise RuntimeError("torch_stream() needs backend='torch'")
        return self._torch.stream(self.stream_handle(stream))

    def close(self) -> None:
        """Joins the engine's threads and frees its slot values now (also done when collected);
        every later call raises weft.Error, a second close() does nothing."""
        self._engine.close()  # first: the engine borrows the callables
        self._callables = []

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
