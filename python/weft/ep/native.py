"""weft.ep's native API: weft::ep::Buffer from torch, with weft's extras (the expanded layout,
the count kept on the device, zero-copy results, per-call num_sms, receive statistics).

    buf = weft.ep.NativeBuffer(group, max_tokens=8192, hidden=7168, num_experts=256, top_k=8)
    res = buf.dispatch(x, topk_idx, topk_weights)           # no host sync
    y = experts(res.recv_x, res.tokens_per_local_expert)   # views into the window: read them
    out, _ = buf.combine(y, res.handle)                    # before the next call on buf

Contracts (docs/python.md):
- Collective: every rank of the group makes the same sequence of calls on its Buffer.
- Results are views into the Buffer's symmetric window, valid until the next dispatch or
  combine on this Buffer is launched (`DispatchResult.copy()` makes owned tensors). Rows
  [0, num_recv) are valid, in (source rank, source token) order.
- Calls run on `comm_stream` (the device's highest priority), after `previous_event` or else
  after the work queued so far on the current stream. With `async_finish=False` the current
  stream waits for the call before it returns; with True the caller waits on the returned event.
- Bad input raises weft.Error (a RuntimeError) and changes nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import Error, _weft
from . import _group
from .event import EventHandle, EventOverlap

_FP8_GROUP = 128


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"


def check_tensor(name: str, t, dtypes: Sequence[torch.dtype], device: torch.device,
                 shape: Tuple[Optional[int], ...]) -> torch.Tensor:
    """Raises weft.Error unless t is a row-major tensor on device with one of dtypes and the
    given shape (None: any size)."""
    if isinstance(t, torch.Tensor) and t.dtype in dtypes and t.device == device and \
            t.dim() == len(shape) and t.is_contiguous() and \
            all(s is None or s == n for s, n in zip(shape, t.shape)):
        return t
    if not isinstance(t, torch.Tensor):
        raise Error(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise Error(f"{name} is on {t.device}, but this Buffer is on {device}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise Error(f"{name} must be {names}, got {_describe(t)}")
    if not t.is_contiguous():
        raise Error(f"{name} must be contiguous (row-major), got strides {t.stride()}; "
                    f"call .contiguous() first")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    raise Error(f"{name} must have shape {want}, got {_describe(t)}")


def pack_fp8(x_e4m3: torch.Tensor, scales: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """weft's packed fp8 rows [T, row_bytes] uint8: the e4m3 payload, then the fp32 scales, then
    zero padding (include/weft/ep/types.hpp). scales may have any strides (DeepEP's tests pass
    a column-major one)."""
    num_tokens, hidden = x_e4m3.shape
    packed = torch.empty((num_tokens, row_bytes), dtype=torch.uint8, device=x_e4m3.device)
    packed[:, :hidden].copy_(x_e4m3.view(torch.uint8))
    num_scale_bytes = 4 * (hidden // _FP8_GROUP)
    packed[:, hidden:hidden + num_scale_bytes].view(torch.float32).copy_(scales)
    packed[:, hidden + num_scale_bytes:].zero_()
    return packed


def unpack_fp8(packed: torch.Tensor, hidden: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Views (x_e4m3 [N, hidden], scales fp32 [N, hidden / 128]) of packed fp8 rows."""
    num_scale_bytes = 4 * (hidden // _FP8_GROUP)
    x = packed[:, :hidden].view(torch.float8_e4m3fn)
    scales = packed[:, hidden:hidden + num_scale_bytes].view(torch.float32)
    return x, scales


@dataclass
class Expand:
    """The expanded layout: one received row per (token, local expert), grouped by local expert
    in segments aligned to expert_alignment rows (a grouped GEMM's input); zero_padding zeroes
    the padding rows. Needs a Buffer built with expand_factor >= 1."""

    expert_alignment: int = 1
    zero_padding: bool = False


@dataclass
class DispatchResult:
    """A dispatch's results: views into the window, valid until the next call on the Buffer.

    recv_x: [capacity, hidden] bf16, or for fp8 the tuple (x_e4m3 [capacity, hidden],
    scales fp32 [capacity, hidden / 128]); recv_expert_idx [capacity, top_k] int32 (local expert
    id or -1); recv_weights [capacity, top_k] fp32 (0 where not local); recv_src [capacity, 2]
    int32 (source rank, source token); tokens_per_local_expert [num_local_experts] int32 and
    num_recv_device [1] int32 on the device; num_recv (int) only when the count was read
    (sync_count=True, or a cached dispatch of such a layout). Expanded: segment_begin
    [num_local_experts + 1] int64, and rows_required with sync_count.
    """

    recv_x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
    recv_expert_idx: torch.Tensor
    recv_weights: torch.Tensor
    recv_src: torch.Tensor
    tokens_per_local_expert: torch.Tensor
    num_recv_device: torch.Tensor
    num_recv: Optional[int]
    tokens_per_local_expert_list: Optional[list]
    segment_begin: Optional[torch.Tensor]
    rows_required: Optional[int]
    handle: object
    event: EventOverlap

    def copy(self, num_rows: Optional[int] = None) -> "DispatchResult":
        """Owned copies of the first num_rows rows (default: num_recv, which must be known) of
        every array, on the current stream: what a caller keeps across later calls."""
        n = self.num_recv if num_rows is None else num_rows
        if n is None:
            raise Error("DispatchResult.copy: the count is on the device; pass num_rows "
                        "(e.g. num_worst_tokens) or dispatch with sync_count=True")
        if isinstance(self.recv_x, tuple):
            x = (self.recv_x[0][:n].clone(), self.recv_x[1][:n].clone())
        else:
            x = self.recv_x[:n].clone()
        return DispatchResult(
            x, self.recv_expert_idx[:n].clone(), self.recv_weights[:n].clone(),
            self.recv_src[:n].clone(), self.tokens_per_local_expert.clone(),
            self.num_recv_device.clone(), self.num_recv, self.tokens_per_local_expert_list,
            None if self.segment_begin is None else self.segment_begin.clone(),
            self.rows_required, self.handle, self.event)


class _Window:
    """Typed views of a Buffer's result regions (their addresses never change)."""

    def __init__(self, native, out, device: torch.device) -> None:
        cap = max(native.capacity, native.expand_capacity)
        k = native.top_k
        num_local = native.num_experts // native.num_ranks

        def region(ptr: int, num_bytes: int) -> torch.Tensor:
            capsule = _weft.device_bytes(ptr, num_bytes, device.index, native)
            return torch.utils.dlpack.from_dlpack(capsule)

        self.recv_x = region(out.recv_x, cap * native.hidden * 2)
        self.recv_expert_idx = region(out.recv_expert_idx, cap * k * 4).view(torch.int32).view(cap, k)
        self.recv_weights = region(out.recv_weights, cap * k * 4).view(torch.float32).view(cap, k)
        self.recv_src = region(out.recv_src, cap * 8).view(torch.int32).view(cap, 2)
        self.tokens_per_local_expert = region(out.tokens_per_local_expert_device,
                                              num_local * 4).view(torch.int32)
        self.num_recv = region(out.num_recv_device, 4).view(torch.int32)
        self.segment_begin = None
        if native.expand_factor > 0 and out.segment_begin:
            self.segment_begin = region(out.segment_begin, (num_local + 2) * 8).view(torch.int64)


def _current_raw_stream(device_index: int) -> int:
    """torch's current stream of the device as a cudaStream_t (without making a Stream object,
    which costs more than the rest of a call's Python)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


# What a call made with async_finish=False returns (DeepEP: an EventOverlap without an event).
_NO_EVENT = EventOverlap(None)


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


class NativeBuffer:
    """weft::ep::Buffer over a torch.distributed NCCL process group (None: one GPU, no
    torch.distributed). Sized at construction: at most max_tokens tokens per rank and call."""

    def __init__(self, group: Optional[dist.ProcessGroup], *, max_tokens: int, hidden: int,
                 num_experts: int, top_k: int, expand_factor: int = 0, num_sms: int = 0,
                 tokens_per_block: int = 4, timeout_s: float = 20.0,
                 pipeline_depth: int = 0) -> None:
        self.group = group
        self.rank, self.num_ranks = _group.group_rank_size(group)
        self.device = _group.current_device()
        sizes = (int(max_tokens), int(hidden), int(num_experts), int(top_k), int(expand_factor))
        unique_id = _weft.ep.unique_id() if self.rank == 0 else None
        unique_id = _group.share(group, unique_id, sizes)
        self._native = _weft.ep.Buffer(unique_id, self.num_ranks, self.rank, self.device.index,
                                       *sizes, num_sms, tokens_per_block, timeout_s,
                                       pipeline_depth)
        self.max_tokens, self.hidden, self.num_experts, self.top_k, self.expand_factor = sizes
        self.num_local_experts = self.num_experts // self.num_ranks
        # The calls' stream: torch's, of the device's highest priority (so that its blocks are
        # admitted ahead of a concurrent compute kernel's as SMs free up). torch's pool streams
        # outlive every tensor that records them, which a stream owned by the Buffer would not.
        self.comm_stream = torch.cuda.Stream(self.device, priority=-1000)
        self._window: Optional[_Window] = None
        self._layout_key: Optional[Tuple[int, int]] = None  # the latest uncached dispatch's
        self._views: dict = {}  # (rows, row_bytes, fp8, expanded) -> the result's views
        self._fp8_row_bytes = (_weft.ep.fp8_row_bytes(self.hidden)
                               if self.hidden % _FP8_GROUP == 0 else None)

    # -- lifetime ---------------------------------------------------------------------------
    def destroy(self) -> None:
        """Frees the window and the communicator now (after the work queued on the device):
        results that view the window are invalid from then on. Without destroy(), the window
        lives until the Buffer and every view of it are released."""
        self._window = None
        self._views = {}
        self._native.destroy()

    @property
    def capacity(self) -> int:
        """Rows a dispatch can receive (expanded: expand_capacity)."""
        return self._native.capacity

    @property
    def expand_capacity(self) -> int:
        return self._native.expand_capacity

    def check(self) -> None:
        """Raises the device error recorded by a completed call (after a stream sync)."""
        self._native.check()

    def _holds_layout(self, handle) -> bool:
        """Whether the window still holds handle's layout (no uncached dispatch since)."""
        return (handle.buffer_id, handle.sequence) == self._layout_key

    # -- streams ------------------------------------------------------------------------------
    def _enter(self, previous_event: Optional[EventOverlap], async_finish: bool,
               allocate_on_comm_stream: bool):
        """Orders the comm stream after previous_event or the current stream's queued work;
        returns the current stream (its cudaStream_t)."""
        if allocate_on_comm_stream and not (previous_event is not None and async_finish):
            raise Error("allocate_on_comm_stream needs previous_event and async_finish "
                        "(as in DeepEP)")
        current = _current_raw_stream(self.device.index)
        event = 0
        if previous_event is not None:
            if previous_event.event is None:
                raise Error("previous_event holds no event (it came from a call made with "
                            "async_finish=False); use Buffer.capture()")
            event = previous_event.event.event.cuda_event
        self._native.enter(current, event, self.comm_stream.cuda_stream)
        return current

    def _allocating(self, on_comm_stream: bool):
        """Where a call's new tensors are allocated: the current stream (DeepEP's default), or
        the comm stream (allocate_on_comm_stream)."""
        return torch.cuda.stream(self.comm_stream) if on_comm_stream else contextlib.nullcontext()

    def _leave(self, current, async_finish: bool, tensors: Sequence[torch.Tensor]) -> EventOverlap:
        """With async_finish=False the current stream waits for the call; else the returned
        event completes with it, and the tensors are kept for the comm stream until then."""
        if not async_finish:
            self._native.leave(current, self.comm_stream.cuda_stream)
            return _NO_EVENT
        if not _capturing():
            for t in tensors:
                t.record_stream(self.comm_stream)
        return EventOverlap(EventHandle(self.comm_stream), extra_tensors=tensors)

    # -- dispatch -------------------------------------------------------------------------------
    def _x_arg(self, x):
        """(packed tensor, dtype name, columns, is_fp8) of a bf16 x or an fp8 (x_e4m3, scales)."""
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise Error(f"fp8 x must be the tuple (x_e4m3, scales), got {len(x)} elements")
            x_e4m3, scales = x
            if self._fp8_row_bytes is None:
                raise Error(f"fp8 dispatch needs hidden a multiple of {_FP8_GROUP}, the Buffer "
                            f"has {self.hidden}")
            check_tensor("x[0] (x_e4m3)", x_e4m3, (torch.float8_e4m3fn,), self.device,
                         (None, self.hidden))
            n = x_e4m3.shape[0]
            if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or \
                    tuple(scales.shape) != (n, self.hidden // _FP8_GROUP) or \
                    scales.device != self.device:
                got = _describe(scales) if isinstance(scales, torch.Tensor) else type(scales).__name__
                raise Error(f"x[1] (scales) must be float32 [{n}, {self.hidden // _FP8_GROUP}] on "
                            f"{self.device}, got {got}")
            packed = pack_fp8(x_e4m3, scales, self._fp8_row_bytes)
            return packed, "uint8", self._fp8_row_bytes, True
        if isinstance(x, torch.Tensor) and x.dtype == torch.uint8:
            check_tensor("x (packed fp8 rows)", x, (torch.uint8,), self.device,
                         (None, self._fp8_row_bytes))
            return x, "uint8", x.shape[1], True
        check_tensor("x", x, (torch.bfloat16,), self.device, (None, self.hidden))
        return x, "bfloat16", self.hidden, False

    def _results(self, out, is_fp8: bool, num_rows: int) -> DispatchResult:
        if self._window is None:
            self._window = _Window(self._native, out, self.device)
        key = (num_rows, out.row_bytes, is_fp8, out.handle.expanded)
        views = self._views.get(key)
        if views is None:
            w = self._window
            row_bytes = out.row_bytes
            x_bytes = w.recv_x[:num_rows * row_bytes].view(num_rows, row_bytes)
            recv_x = unpack_fp8(x_bytes, self.hidden) if is_fp8 else x_bytes.view(torch.bfloat16)
            views = (recv_x, w.recv_expert_idx[:num_rows], w.recv_weights[:num_rows],
                     w.recv_src[:num_rows], w.tokens_per_local_expert, w.num_recv,
                     w.segment_begin[:self.num_local_experts + 1] if key[3] else None)
            if len(self._views) > 8:  # counts read to the host make a key per count
                self._views.clear()
            self._views[key] = views
        num_recv = out.num_recv if out.num_recv >= 0 else out.handle.num_recv
        expanded = key[3]
        return DispatchResult(
            *views[:6], num_recv if num_recv >= 0 else None,
            list(out.tokens_per_local_expert) if out.num_recv >= 0 else None, views[6],
            out.rows_required if expanded and out.rows_required >= 0 else None, out.handle,
            _NO_EVENT)

    def dispatch(self, x, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *, handle=None,
                 expand: Optional[Expand] = None, num_sms: int = 0,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 sync_count: bool = False, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False,
                 on_current_stream: bool = False) -> DispatchResult:
        """Sends each token of x [T, hidden] (bf16; or fp8 as (x_e4m3, scales) or packed rows)
        to the ranks of its top-k experts (topk_idx [T, top_k] int32/int64, -1 = none;
        topk_weights [T, top_k] fp32). With handle (a previous result's), reuses that layout:
        only x moves. sync_count=True reads the count to the host (one host wait), so that
        num_recv and tokens_per_local_expert_list are known and the arrays are sliced to
        num_recv rows; else they span the capacity and the count stays on the device.
        on_current_stream=True runs the kernel on the current stream itself instead of the comm
        stream (no stream hand-off: the cheapest call; the caller orders it with the Buffer's
        other calls, as a stream does)."""
        packed, x_dtype, x_cols, is_fp8 = self._x_arg(x)
        num_tokens = packed.shape[0]
        if num_tokens > self.max_tokens:
            raise Error(f"dispatch of {num_tokens} tokens, but this Buffer was sized for at most "
                        f"{self.max_tokens} per rank")
        idx_ptr = w_ptr = 0
        idx_dtype = "int64"
        tensors = [packed]
        if handle is None:
            if topk_idx is None or topk_weights is None:
                raise Error("dispatch needs topk_idx and topk_weights (or a handle)")
            check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), self.device,
                         (num_tokens, self.top_k))
            check_tensor("topk_weights", topk_weights, (torch.float32,), self.device,
                         (num_tokens, self.top_k))
            idx_ptr, w_ptr = topk_idx.data_ptr(), topk_weights.data_ptr()
            idx_dtype = "int64" if topk_idx.dtype == torch.int64 else "int32"
            tensors += [topk_idx, topk_weights]
        elif topk_idx is not None or topk_weights is not None:
            raise Error("a cached dispatch (handle=...) takes no topk_idx / topk_weights")
        stats_ptr = 0
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                         (torch.int32,), self.device, (self.num_local_experts,))
            stats_ptr = cumulative_local_expert_recv_stats.data_ptr()
            tensors.append(cumulative_local_expert_recv_stats)
        if sync_count and _capturing():
            raise Error("sync_count=True waits on the host, which a CUDA graph capture cannot; "
                        "keep the count on the device")
        if on_current_stream:
            self._check_on_current(previous_event, async_finish, allocate_on_comm_stream)
            return self._launch_dispatch(packed, x_dtype, x_cols, is_fp8, idx_ptr, idx_dtype,
                                         w_ptr, handle, stats_ptr, num_sms, expand, sync_count,
                                         _current_raw_stream(self.device.index))
        current = self._enter(previous_event, async_finish, allocate_on_comm_stream)
        result = self._launch_dispatch(packed, x_dtype, x_cols, is_fp8, idx_ptr, idx_dtype, w_ptr,
                                       handle, stats_ptr, num_sms, expand, sync_count)
        result.event = self._leave(current, async_finish, tensors)
        return result

    @staticmethod
    def _check_on_current(previous_event, async_finish, allocate_on_comm_stream) -> None:
        if previous_event is not None or async_finish or allocate_on_comm_stream:
            raise Error("on_current_stream=True runs the call on the current stream: it takes no "
                        "previous_event, async_finish or allocate_on_comm_stream")

    def _launch_dispatch(self, packed, x_dtype, x_cols, is_fp8, idx_ptr, idx_dtype, w_ptr,
                         handle, stats_ptr, num_sms, expand, sync_count,
                         stream: Optional[int] = None) -> DispatchResult:
        """The dispatch kernel on stream (default: comm_stream, ordered by the caller's _enter
        and _leave)."""
        expand_on = expand is not None
        out = self._native.dispatch(
            packed.data_ptr(), x_dtype, packed.shape[0], x_cols, idx_ptr, idx_dtype, w_ptr,
            handle, stats_ptr, num_sms, expand_on, expand.expert_alignment if expand_on else 1,
            expand.zero_padding if expand_on else False,
            self.comm_stream.cuda_stream if stream is None else stream,
            bool(sync_count and handle is None))
        if handle is None:
            self._layout_key = (out.handle.buffer_id, out.handle.sequence)
        num_recv = out.num_recv if out.num_recv >= 0 else out.handle.num_recv
        return self._results(out, is_fp8, num_recv if num_recv >= 0 else out.capacity)

    # -- combine --------------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle, *,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                out: Optional[torch.Tensor] = None, num_sms: int = 0,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False,
                on_current_stream: bool = False) -> Tuple[torch.Tensor, EventOverlap]:
        """Sums, per source token, the rows of expert_out [>= num_recv, hidden] bf16 (in the
        received-row order of handle's dispatch) back at their source, plus bias (one [T, hidden]
        bf16 tensor or a pair). Returns (out [T, hidden] bf16, event). on_current_stream as for
        dispatch."""
        check_tensor("x (expert output)", expert_out, (torch.bfloat16,), self.device,
                     (None, self.hidden))
        if not isinstance(handle, _weft.ep.Handle):
            raise Error(f"handle must be a weft.ep dispatch handle, got {type(handle).__name__}")
        num_tokens = handle.num_tokens
        biases = [] if bias is None else list(bias) if isinstance(bias, (tuple, list)) else [bias]
        if len(biases) > 2:
            raise Error(f"bias takes one tensor or a pair, got {len(biases)}")
        for i, b in enumerate(biases):
            check_tensor(f"bias[{i}]", b, (torch.bfloat16,), self.device,
                         (num_tokens, self.hidden))
        if on_current_stream:
            self._check_on_current(previous_event, async_finish, allocate_on_comm_stream)
        else:
            current = self._enter(previous_event, async_finish, allocate_on_comm_stream)
        if out is None:
            with self._allocating(allocate_on_comm_stream):
                out = torch.empty((num_tokens, self.hidden), dtype=torch.bfloat16,
                                  device=self.device)
        else:
            check_tensor("out", out, (torch.bfloat16,), self.device, (num_tokens, self.hidden))
        if on_current_stream:
            self._launch_combine(expert_out, handle, biases, out, num_sms,
                                 _current_raw_stream(self.device.index))
            return out, _NO_EVENT
        self._launch_combine(expert_out, handle, biases, out, num_sms)
        event = self._leave(current, async_finish, [expert_out, out, *biases])
        return out, event

    def _launch_combine(self, expert_out, handle, biases, out, num_sms,
                        stream: Optional[int] = None) -> None:
        ptrs = [b.data_ptr() for b in biases] + [0] * (2 - len(biases))
        self._native.combine(expert_out.data_ptr(), expert_out.shape[0], ptrs[0], ptrs[1],
                             handle, out.data_ptr(), num_sms,
                             self.comm_stream.cuda_stream if stream is None else stream)
