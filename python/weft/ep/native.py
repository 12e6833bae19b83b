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
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import Error, _weft
from . import lifetime
from .communicator import Communicator
from .event import EventHandle, EventOverlap
from .torch_modes import outside_torch_function_modes

_FP8_GROUP = 128
# torch's dtypes are singletons: the plain calls' checks compare them by identity.
_T_BF16, _T_F32, _T_I32, _T_I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
_BF16 = _weft.ep.DType.bfloat16 if hasattr(_weft.ep, "DType") else None
_UINT8 = _weft.ep.DType.uint8 if hasattr(_weft.ep, "DType") else None


def flat(x):
    """A tensor or the fp8 pair as a tuple of tensors (None: empty)."""
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"


def check_tensor(name: str, t, dtypes: Sequence[torch.dtype], device: torch.device,
                 shape: Tuple[Optional[int], ...]) -> torch.Tensor:
    """Raises weft.Error unless t is a row-major tensor on device with one of dtypes and the
    given shape (None: any size)."""
    # The accepted case first, in the cheapest order (this runs several times per call).
    if isinstance(t, torch.Tensor) and t.dtype in dtypes and t.device == device and \
            t.is_contiguous():
        got = t.shape
        if len(got) == len(shape):
            for want, n in zip(shape, got):
                if want is not None and want != n:
                    break
            else:
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


def check_x(x, hidden: int, device: torch.device) -> Tuple[int, bool]:
    """(num_tokens, is_fp8) of a dispatch's x; raises weft.Error unless x is bf16 [T, hidden],
    the fp8 pair (x_e4m3 [T, hidden], scales fp32 [T, hidden / 128], any strides) or packed fp8
    rows [T, fp8_row_bytes(hidden)] uint8, on device."""
    if isinstance(x, (tuple, list)) or (isinstance(x, torch.Tensor) and x.dtype == torch.uint8):
        if hidden % _FP8_GROUP != 0:
            raise Error(f"fp8 dispatch needs hidden a multiple of {_FP8_GROUP}, got {hidden}")
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise Error(f"fp8 x must be the tuple (x_e4m3, scales), got {len(x)} elements")
        x_e4m3, scales = x
        check_tensor("x[0] (x_e4m3)", x_e4m3, (torch.float8_e4m3fn,), device, (None, hidden))
        n = x_e4m3.shape[0]
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or \
                tuple(scales.shape) != (n, hidden // _FP8_GROUP) or scales.device != device:
            got = _describe(scales) if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise Error(f"x[1] (scales) must be float32 [{n}, {hidden // _FP8_GROUP}] on "
                        f"{device}, got {got}")
        return n, True
    if isinstance(x, torch.Tensor) and x.dtype == torch.uint8:
        check_tensor("x (packed fp8 rows)", x, (torch.uint8,), device,
                     (None, _weft.ep.fp8_row_bytes(hidden)))
        return x.shape[0], True
    check_tensor("x", x, (torch.bfloat16,), device, (None, hidden))
    return x.shape[0], False


def plain_token_rows(x, device_index: int) -> Optional[Tuple[int, int]]:
    """(num_tokens, hidden) where a dispatch's x is of the accepted case on the device of
    device_index: a contiguous bf16 [T, hidden], or the fp8 pair (a contiguous e4m3
    [T, hidden], fp32 scales [T, hidden / 128] at any strides), checked with the least host
    work; None otherwise (check_x then says what is wrong)."""
    try:
        is_fp8 = isinstance(x, (tuple, list))
        if is_fp8:
            if len(x) != 2:
                return None
            x, scales = x
            if x.dtype is not torch.float8_e4m3fn:
                return None
        elif x.dtype is not _T_BF16:
            return None
        num_tokens, hidden = x.shape
        if not (x.get_device() == device_index and x.is_contiguous()):
            return None
        if is_fp8 and not (hidden % _FP8_GROUP == 0 and scales.dtype is _T_F32 and
                           scales.shape == (num_tokens, hidden // _FP8_GROUP) and
                           scales.get_device() == device_index):
            return None
    except (AttributeError, TypeError, ValueError):  # not tensors, or not 2-d
        return None
    return num_tokens, hidden


def pack_fp8(x_e4m3: torch.Tensor, scales: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """weft's packed fp8 rows [T, row_bytes] uint8: the e4m3 payload, then the fp32 scales, then
    zero padding (include/weft/ep/types.hpp). scales may have any strides. (dispatch takes the
    pair itself and packs on the way; this is for callers that keep packed rows.)"""
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


class NativeHandle(NamedTuple):
    """A dispatch's layout as weft::ep::Handle names it (what combine and a cached dispatch take):
    the Buffer's id, the layout's number, T, the rows received (-1: not read), the expanded
    layout's options, and tokens_required (-1: not read; > 0: the dispatch moved no rows);
    segment_stride (expanded): 0 packed segments, > 0 segment e at e * segment_stride."""

    buffer_id: int
    sequence: int
    num_tokens: int
    num_recv: int
    expanded: bool
    expert_alignment: int
    zero_padding: bool
    tokens_required: int
    segment_stride: int = 0


class DispatchCounts:
    """What a dispatch whose results are copied out needs of it (no views of the window):
    handle, and with the counts read, num_recv, tokens_per_local_expert_list and
    tokens_required (else None). The list is made when first read: an owned dispatch launches
    its copy kernel before it, while the GPU waits."""

    __slots__ = ("handle", "num_recv", "tokens_required", "copied", "_out", "_list")

    def __init__(self, handle: NativeHandle, out) -> None:
        self.handle = handle
        self.copied = out.copied  # the copy given to launch_dispatch ran (and handed back)
        if out.num_recv < 0:
            out = None
        self._out, self._list = out, None
        self.num_recv = None if out is None else out.num_recv
        self.tokens_required = None if out is None else out.tokens_required

    @property
    def tokens_per_local_expert_list(self) -> Optional[list]:
        if self._list is None and self._out is not None:
            self._list = self._out.tokens_per_local_expert  # each read makes a new list
        return self._list


@dataclass
class Expand:
    """The expanded layout: one received row per (token, local expert), grouped by local expert
    in segments aligned to expert_alignment rows (a grouped GEMM's input); zero_padding zeroes
    the padding rows. Needs a Buffer built with expand_factor >= 1."""

    expert_alignment: int = 1
    zero_padding: bool = False
    # > 0: fixed-stride segments, segment e at row e * segment_stride (a [E_local, stride, row]
    # array: DeepEP's low-latency layout); needs expand_factor * R * max_tokens >= E_local * stride.
    segment_stride: int = 0


@dataclass
class DispatchResult:
    """A dispatch's results: views into the window, valid until the next call on the Buffer.

    recv_x: [capacity, hidden] bf16, or for fp8 the tuple (x_e4m3 [capacity, hidden],
    scales fp32 [capacity, hidden / 128]); recv_expert_idx [capacity, top_k] int32 (local expert
    id or -1); recv_weights [capacity, top_k] fp32 (0 where not local); recv_src [capacity, 2]
    int32 (source rank, source token); tokens_per_local_expert [num_local_experts] int32 and
    num_recv_device [1] int32 on the device; num_recv (int) only when the count was read
    (sync_count=True, or a cached dispatch of such a layout). Expanded: segment_begin
    [num_local_experts + 1] int64, and rows_required with sync_count. rank_prefix_matrix
    [R, R] int32 on the device: rows rank j received from ranks 0..i (DeepEP's handle[0]; None
    for the expanded layout).
    tokens_required (sync_count only): 0, or the most tokens any rank sent when that was more
    than max_tokens, in which case no row moved on any rank (grow the window and retry).
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
    rank_prefix_matrix: torch.Tensor
    tokens_required: Optional[int]
    handle: object
    event: EventOverlap
    buffer: object = None  # the NativeBuffer whose window the views are of

    def copy(self, num_rows: Optional[int] = None) -> "DispatchResult":
        """Owned copies of the first num_rows rows (default: num_recv, which must be known) of
        every array, on the current stream, in one kernel: what a caller keeps across later
        calls. Rows past the received count are padding (see NativeBuffer.copy_out). Only the
        latest dispatch's result is in the window."""
        n = self.num_recv if num_rows is None else num_rows
        if n is None:
            raise Error("DispatchResult.copy: the count is on the device; pass num_rows "
                        "(e.g. num_worst_tokens) or dispatch with sync_count=True")
        owned = [torch.empty((n, *v.shape[1:]), dtype=v.dtype, device=v.device)
                 for v in (*flat(self.recv_x), self.recv_expert_idx, self.recv_weights,
                           self.recv_src)]
        recv_x = tuple(owned[:2]) if isinstance(self.recv_x, tuple) else owned[0]
        idx, w, src = owned[-3:]
        self.buffer.copy_out(n, recv_x, src=src, topk_idx=idx, topk_weights=w,
                             stream=_current_raw_stream(idx.device.index))
        return DispatchResult(
            recv_x, idx, w, src, self.tokens_per_local_expert.clone(),
            self.num_recv_device.clone(), self.num_recv,
            None if self.tokens_per_local_expert_list is None
            else list(self.tokens_per_local_expert_list),
            None if self.segment_begin is None else self.segment_begin.clone(),
            self.rows_required,
            None if self.rank_prefix_matrix is None else self.rank_prefix_matrix.clone(),
            self.tokens_required, self.handle, self.event, self.buffer)


class _Window:
    """Typed views of a Buffer's result regions (their addresses never change). Each view's
    capsule holds the window itself, so a view outlives the Buffer object safely."""

    def __init__(self, native, out, device: torch.device) -> None:
        self._native = native
        cap = max(native.capacity, native.expand_capacity)
        k = native.top_k
        self.num_local = native.num_experts // native.num_ranks
        self.recv_x = self._region(out.recv_x, cap * native.hidden * 2)
        self.recv_expert_idx = self._region(out.recv_expert_idx, cap * k * 4).view(
            torch.int32).view(cap, k)
        self.recv_weights = self._region(out.recv_weights, cap * k * 4).view(
            torch.float32).view(cap, k)
        self.recv_src = self._region(out.recv_src, cap * 8).view(torch.int32).view(cap, 2)
        self.tokens_per_local_expert = self._region(out.tokens_per_local_expert_device,
                                                    self.num_local * 4).view(torch.int32)
        self.num_recv = self._region(out.num_recv_device, 4).view(torch.int32)
        self.num_ranks = native.num_ranks
        self.segment_begin: Optional[torch.Tensor] = None
        self.rank_prefix_matrix: Optional[torch.Tensor] = None
        self.add(out)

    def _region(self, ptr: int, num_bytes: int) -> torch.Tensor:
        return torch.utils.dlpack.from_dlpack(self._native.window_bytes(ptr, num_bytes))

    def add(self, out) -> None:
        """Views what only some results have (an expanded dispatch's segments)."""
        if self.segment_begin is None and out.segment_begin:
            self.segment_begin = self._region(out.segment_begin,
                                              (self.num_local + 2) * 8).view(torch.int64)
        if self.rank_prefix_matrix is None and out.rank_prefix_matrix:
            r = self.num_ranks
            self.rank_prefix_matrix = self._region(out.rank_prefix_matrix, r * r * 4).view(
                torch.int32).view(r, r)


def fill_token_rows(rows, x) -> None:
    """rows (the binding's TokenRows, in place) describes x: bf16 rows, packed fp8 rows (uint8),
    or the fp8 pair (x_e4m3, scales) with the scales' strides."""
    if isinstance(x, (tuple, list)):
        x_e4m3, scales = x
        rows.data = x_e4m3.data_ptr()
        rows.scales = scales.data_ptr()
        rows.scales_token_stride, rows.scales_group_stride = scales.stride()
        rows.num_tokens, rows.cols = x_e4m3.shape
        rows.dtype = _UINT8
    else:
        rows.data = x.data_ptr()
        rows.scales = 0
        rows.num_tokens, rows.cols = x.shape
        rows.dtype = _UINT8 if x.dtype == torch.uint8 else _BF16


def set_own_rows(rows, own, x, is_fp8: bool, num_tokens: int) -> None:
    """Both TokenRows of an owned dispatch (the launch's rows, and its copy's own_x: the same x),
    in place, of argument objects whose dtype and cols are set already (reused ones): x is a
    contiguous bf16 [num_tokens, hidden], or (is_fp8) the pair (x_e4m3, scales) with the
    scales' strides."""
    if is_fp8:
        x_e4m3, scales = x
        own.data = rows.data = x_e4m3.data_ptr()
        own.scales = rows.scales = scales.data_ptr()
        own.scales_token_stride, own.scales_group_stride = scales.stride()
        rows.scales_token_stride = own.scales_token_stride
        rows.scales_group_stride = own.scales_group_stride
    else:
        own.data = rows.data = x.data_ptr()
    own.num_tokens = rows.num_tokens = num_tokens


def set_copy_out_rows(args, num_rows: int, recv_x) -> None:
    """The rows of a copy_out's arguments (the binding's CopyOutArgs, in place): num_rows and
    recv_x, a bf16 or fp8 tensor, or the fp8 pair (x_e4m3, scales)."""
    args.num_rows = num_rows
    if isinstance(recv_x, tuple):
        args.x, args.x_scales = recv_x[0].data_ptr(), recv_x[1].data_ptr()
    else:
        args.x = recv_x.data_ptr()


def _current_raw_stream(device_index: int) -> int:
    """torch's current stream of the device as a cudaStream_t (without making a Stream object,
    which costs more than the rest of a call's Python)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


# What a call made with async_finish=False returns (DeepEP: an EventOverlap without an event).
_NO_EVENT = EventOverlap(None)


def no_event(previous_event) -> bool:
    """Whether previous_event orders nothing: None, or an EventOverlap without an event (what a
    call made with async_finish=False returns)."""
    return previous_event is None or (type(previous_event) is EventOverlap and
                                      previous_event.event is None)


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def event_of(previous_event: Optional[EventOverlap]) -> int:
    """The cudaEvent_t a call waits on: 0 for None or an EventOverlap that holds no event (what a
    call with async_finish=False returns; DeepEP takes it as "no previous event")."""
    if previous_event is None:
        return 0
    if not isinstance(previous_event, EventOverlap):
        raise Error(f"previous_event must be an EventOverlap (Buffer.capture()), got "
                    f"{type(previous_event).__name__}")
    if previous_event.event is None:
        return 0
    return previous_event.event.event.cuda_event


def async_event(comm_stream: torch.cuda.Stream, tensors) -> EventOverlap:
    """The completion event of a call queued on comm_stream. It keeps the call's tensors (None
    entries skipped) until the wait, and outside graph capture the comm stream is recorded on
    them, so that the caching allocator cannot hand their memory out under the call."""
    tensors = [t for t in tensors if t is not None]
    if not _capturing():
        for t in tensors:
            t.record_stream(comm_stream)
    return EventOverlap(EventHandle(comm_stream), extra_tensors=tensors)


def check_stream_options(previous_event, async_finish: bool, allocate_on_comm_stream: bool,
                         on_current_stream: bool = False) -> None:
    """Raises weft.Error for a combination of DeepEP's stream options that DeepEP refuses, or
    any of them with weft's on_current_stream."""
    if on_current_stream and (previous_event is not None or async_finish or
                              allocate_on_comm_stream):
        raise Error("on_current_stream=True runs the call on the current stream: it takes no "
                    "previous_event, async_finish or allocate_on_comm_stream")
    if allocate_on_comm_stream and not (previous_event is not None and async_finish):
        raise Error("allocate_on_comm_stream needs previous_event and async_finish "
                    "(as in DeepEP)")


class CommCall:
    """A call composed of several launches on a Buffer's comm stream (DeepEP's stream protocol):

        with CommCall(buf, previous_event, async_finish, allocate_on_comm_stream) as call:
            ... launches on torch's current stream (now the comm stream) ...
            with call.allocating(): out = torch.empty(...)   # the caller's tensors
            call.keep(out, inputs...)
        event = call.event

    buffer: a NativeBuffer, or anything with its comm_stream, device, enter_comm and leave_comm.
    On entry the comm stream waits for previous_event, or else for the work queued so far on the
    caller's stream, and becomes torch's current stream. On exit (also on an error) the caller's
    stream is current again; with async_finish=False it waits for the comm stream, else `event`
    completes with the call and keeps the kept tensors (and the comm stream is recorded on them
    outside graph capture) so that the caching allocator cannot reuse them under the call.
    """

    def __init__(self, buffer, previous_event, async_finish: bool,
                 allocate_on_comm_stream: bool = False) -> None:
        check_stream_options(previous_event, async_finish, allocate_on_comm_stream)
        event_of(previous_event)  # checks it
        self.buffer = buffer
        self.previous_event = previous_event
        self.async_finish = async_finish
        self.allocate_on_comm_stream = allocate_on_comm_stream
        self.event = _NO_EVENT
        self._keep: list = []

    def __enter__(self) -> "CommCall":
        b = self.buffer
        self.caller = torch.cuda.current_stream(b.device)
        b.enter_comm(self.caller, self.previous_event)
        self._context = torch.cuda.stream(b.comm_stream)
        self._context.__enter__()
        return self

    def allocating(self):
        """Where the call's results are allocated: the caller's stream (DeepEP's default), or the
        comm stream (allocate_on_comm_stream)."""
        if self.allocate_on_comm_stream:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.caller)

    def keep(self, *tensors) -> None:
        self._keep.extend(t for t in tensors if t is not None)

    def __exit__(self, exc_type, exc, tb) -> None:
        self._context.__exit__(exc_type, exc, tb)
        b = self.buffer
        if not self.async_finish:
            b.leave_comm(self.caller)
            return
        self.event = async_event(b.comm_stream, self._keep)


class NativeBuffer:
    """weft::ep::Buffer over a torch.distributed NCCL process group (None: one GPU, no
    torch.distributed). Sized at construction: at most max_tokens tokens per rank and call.

    communicator: a Communicator to lay the window out on (e.g. one kept across windows); by
    default the Buffer makes its own, checking that every rank passed the same sizes.
    comm_stream: the stream of its calls; by default a torch stream of the device's highest
    priority (so that its blocks are admitted ahead of a concurrent compute kernel's as SMs free
    up; torch's pool streams outlive every tensor that records them)."""

    def __init__(self, group: Optional[dist.ProcessGroup], *, max_tokens: int, hidden: int,
                 num_experts: int, top_k: int, expand_factor: int = 0, num_sms: int = 0,
                 tokens_per_block: int = 4, timeout_s: float = 20.0,
                 pipeline_depth: int = 0, communicator: Optional[Communicator] = None,
                 comm_stream: Optional[torch.cuda.Stream] = None) -> None:
        sizes = (int(max_tokens), int(hidden), int(num_experts), int(top_k), int(expand_factor))
        self._owns_communicator = communicator is None
        if communicator is None:
            communicator = Communicator(group, sizes)
        elif communicator.group is not group:
            raise Error("NativeBuffer: the communicator was made over another group")
        if not communicator.alive:
            raise Error("NativeBuffer: the communicator was destroyed")
        self.group = group
        self.communicator = communicator
        native = _weft.ep.Buffer(
            communicator.native, max_tokens=sizes[0], hidden=sizes[1], num_experts=sizes[2],
            top_k=sizes[3], expand_factor=sizes[4], num_sms=num_sms,
            tokens_per_block=tokens_per_block, timeout_s=timeout_s,
            pipeline_depth=pipeline_depth)
        self._adopt(native, sizes, comm_stream, virtual=False)

    def _adopt(self, native, sizes: Tuple[int, ...], comm_stream: Optional[torch.cuda.Stream],
               virtual: bool) -> None:
        self._native = native
        self.virtual = virtual
        self.rank, self.num_ranks = native.rank, native.num_ranks
        self.device = torch.device("cuda", native.device)
        lifetime.track_buffer(self)
        self.max_tokens, self.hidden, self.num_experts, self.top_k, self.expand_factor = sizes
        self.num_local_experts = self.num_experts // self.num_ranks
        self.comm_stream = comm_stream if comm_stream is not None else \
            torch.cuda.Stream(self.device, priority=-1000)
        self._window: Optional[_Window] = None
        self._layout_key: Optional[Tuple[int, int]] = None  # the latest uncached dispatch's
        self._views: dict = {}  # (rows, row_bytes, fp8, expanded) -> the result's views
        self._device_index = self.device.index
        self._capacity = native.capacity  # capacity, for the plain calls' checks
        self._reused_args: dict = {}  # reused_args
        # The fields of every plain dispatch's result but its handle (_plain_dispatch).
        self._plain_result: Optional[tuple] = None
        self.fp8_row_bytes = (_weft.ep.fp8_row_bytes(self.hidden)
                               if self.hidden % _FP8_GROUP == 0 else None)

    @classmethod
    def virtual_team(cls, num_ranks: int, *, max_tokens: int, hidden: int, num_experts: int,
                     top_k: int, expand_factor: int = 0, num_sms: int = 0,
                     tokens_per_block: int = 4, timeout_s: float = 20.0) -> List["NativeBuffer"]:
        """num_ranks Buffers of one virtual team on the current device: simulated ranks in one
        process, each with its own window in this GPU's memory, the kernels and the protocol of
        the NCCL path (docs/ep.md "Virtual team"; one GPU's memory stands in for NVLink). Drive
        it from one thread with every rank's call i launched before anything waits for a call i:
        each rank on a stream of its own with on_current_stream=True (or with async_finish=True),
        the count on the device (sync_count=True would wait for ranks not launched yet: refused).
        num_sms: at most a rank's share of the SMs (0 = that share: SMs / num_ranks), so that
        every rank's grid is resident at once."""
        sizes = (int(max_tokens), int(hidden), int(num_experts), int(top_k), int(expand_factor))
        natives = _weft.ep.virtual_team(
            int(num_ranks), max_tokens=sizes[0], hidden=sizes[1], num_experts=sizes[2],
            top_k=sizes[3], expand_factor=sizes[4], num_sms=num_sms,
            tokens_per_block=tokens_per_block, timeout_s=timeout_s)
        team = []
        for native in natives:
            buf = cls.__new__(cls)
            buf.group = buf.communicator = None
            buf._owns_communicator = False
            buf._adopt(native, sizes, None, virtual=True)
            team.append(buf)
        return team

    # -- lifetime ---------------------------------------------------------------------------
    def destroy(self) -> None:
        """Frees the window now (after the work queued on the device): results that view the
        window are invalid from then on. A communicator the Buffer made itself goes with it.
        Without destroy(), the window lives until the Buffer and every view of it are released
        (and at the latest until the interpreter exits)."""
        self._window = None
        self._views = {}
        self._plain_result = None
        self._reused_args = {}
        if self._native is not None:
            self._native.destroy()
        if self._owns_communicator and self.communicator.alive:
            self.communicator.destroy()

    def _release_at_exit(self) -> None:
        self.destroy()
        self._native = None

    @property
    def alive(self) -> bool:
        return self._native is not None and self._native.alive

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

    def enter_comm(self, caller: torch.cuda.Stream, previous_event) -> None:
        """comm_stream waits for previous_event, or else for the work queued so far on caller."""
        self._native.enter_comm(caller.cuda_stream, self.comm_stream.cuda_stream,
                                event_of(previous_event))

    def leave_comm(self, caller: torch.cuda.Stream) -> None:
        """caller waits for the work queued so far on comm_stream."""
        self._native.leave_comm(caller.cuda_stream, self.comm_stream.cuda_stream)

    def reused_args(self, kind, make, *make_args):
        """The argument object (e.g. a DispatchArgs) of this window's calls of one kind, made by
        make(*make_args) at the first and reused by every later one, so that a hot call sets
        only the fields it varies: every call of a kind must set every field that any call of
        that kind varies. The binding copies its arguments at entry. (A Buffer is called from
        one thread at a time: its calls are collective and ordered.)"""
        a = self._reused_args.get(kind)
        if a is None:
            a = self._reused_args[kind] = make(*make_args)
        return a

    def note_layout(self, handle) -> None:
        """An uncached dispatch with this handle (the binding's tuple, or a NativeHandle) was
        launched: its layout is the one in the window now (holds_layout)."""
        self._layout_key = (handle[0], handle[1])

    def hand_back(self, stream: int) -> None:
        """stream (a cudaStream_t) waits for the work queued so far on comm_stream: what a
        dispatch made with hold leaves to copy_out, where the call cannot go on."""
        self._native.leave_comm(stream, self.comm_stream.cuda_stream)

    def holds_layout(self, handle) -> bool:
        """Whether the window still holds handle's layout (no uncached dispatch since)."""
        return (handle.buffer_id, handle.sequence) == self._layout_key

    # -- dispatch -------------------------------------------------------------------------------
    def check_x(self, x) -> Tuple[int, bool]:
        """(num_tokens, is_fp8) of a dispatch's x (see the module's check_x)."""
        return check_x(x, self.hidden, self.device)

    def check_selections(self, num_tokens: int, topk_idx, topk_weights) -> None:
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), self.device,
                     (num_tokens, self.top_k))
        check_tensor("topk_weights", topk_weights, (torch.float32,), self.device,
                     (num_tokens, self.top_k))

    def _results(self, out, handle: NativeHandle, is_fp8: bool, num_rows: int) -> DispatchResult:
        if self._window is None:
            self._window = _Window(self._native, out, self.device)
        else:
            self._window.add(out)
        key = (num_rows, out.row_bytes, is_fp8, handle.expanded)
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
        num_recv = out.num_recv if out.num_recv >= 0 else handle.num_recv
        expanded = key[3]
        return DispatchResult(
            *views[:6], num_recv if num_recv >= 0 else None,
            out.tokens_per_local_expert if out.num_recv >= 0 else None, views[6],
            out.rows_required if expanded and out.rows_required >= 0 else None,
            None if expanded else self._window.rank_prefix_matrix,
            out.tokens_required if out.num_recv >= 0 else None,
            handle, _NO_EVENT, self)

    @outside_torch_function_modes
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
        num_recv rows; else they span the capacity and the count stays on the device. T may
        exceed max_tokens (an uncached, deduplicated dispatch): then no rank moves a row and
        every rank reports the largest T in tokens_required (sync_count; else as a device error
        of the next call), so that every rank can build a larger Buffer.
        on_current_stream=True runs the kernel on the current stream itself instead of the comm
        stream (no stream hand-off: the cheapest call; the caller orders it with the Buffer's
        other calls, as a stream does)."""
        if handle is None and expand is None and cumulative_local_expert_recv_stats is None \
                and no_event(previous_event) and not (sync_count or async_finish or
                                                      allocate_on_comm_stream):
            result = self._plain_dispatch(x, topk_idx, topk_weights, num_sms, on_current_stream)
            if result is not None:
                return result
        num_tokens, is_fp8 = self.check_x(x)
        if handle is None:
            if topk_idx is None or topk_weights is None:
                raise Error("dispatch needs topk_idx and topk_weights (or a handle)")
            self.check_selections(num_tokens, topk_idx, topk_weights)
        elif topk_idx is not None or topk_weights is not None:
            raise Error("a cached dispatch (handle=...) takes no topk_idx / topk_weights")
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                         (torch.int32,), self.device, (self.num_local_experts,))
        if sync_count and self.virtual:
            raise Error("sync_count=True on a virtual team member would wait on the host for "
                        "ranks not launched yet (one thread drives every rank): keep the count on "
                        "the device (num_recv_device) and read it after every rank's call")
        if sync_count and _capturing():
            raise Error("sync_count=True waits on the host, which a CUDA graph capture cannot; "
                        "keep the count on the device")
        check_stream_options(previous_event, async_finish, allocate_on_comm_stream,
                             on_current_stream)
        stats = cumulative_local_expert_recv_stats
        current = _current_raw_stream(self.device.index)
        if on_current_stream:
            return self.launch_dispatch(x, is_fp8, topk_idx, topk_weights, handle, stats,
                                        num_sms, expand, sync_count, current)
        result = self.launch_dispatch(x, is_fp8, topk_idx, topk_weights, handle, stats,
                                      num_sms, expand, sync_count, current,
                                      self.comm_stream.cuda_stream, event_of(previous_event),
                                      async_finish)
        if async_finish:
            result.event = async_event(self.comm_stream, [*flat(x), topk_idx, topk_weights,
                                                          stats])
        return result

    def _plain_dispatch(self, x, topk_idx, topk_weights, num_sms,
                        on_current_stream) -> Optional[DispatchResult]:
        """The common dispatch (bf16 x with its selections, the count on the device, no event)
        with the least host work: the accepted case checked alone (None for anything else: the
        general path then checks it and raises what is wrong), reused arguments, and the
        result's views made once."""
        try:
            xs, ks, ws = x.shape, topk_idx.shape, topk_weights.shape
            idx_dtype = topk_idx.dtype
            d = self._device_index
            if not (x.dtype is _T_BF16 and (idx_dtype is _T_I64 or idx_dtype is _T_I32) and
                    topk_weights.dtype is _T_F32 and len(xs) == 2 and xs[1] == self.hidden and
                    len(ks) == 2 and ks[0] == xs[0] and ks[1] == self.top_k and ks == ws and
                    x.get_device() == d and topk_idx.get_device() == d and
                    topk_weights.get_device() == d and x.is_contiguous() and
                    topk_idx.is_contiguous() and topk_weights.is_contiguous() and
                    type(num_sms) is int):
                return None
        except AttributeError:  # not tensors
            return None
        a = self._plain_args(_weft.ep.DispatchArgs, on_current_stream)
        rows = a.x
        rows.data = x.data_ptr()
        rows.num_tokens = xs[0]
        a.topk_idx = topk_idx.data_ptr()
        a.topk_idx_int64 = idx_dtype is _T_I64
        a.topk_weights = topk_weights.data_ptr()
        a.num_sms = num_sms
        a.stream = _current_raw_stream(d)
        out = self._native.dispatch(a, None, None)
        handle = NativeHandle(*out.handle)
        self.note_layout(handle)
        fixed = self._plain_result
        if fixed is None:
            result = self._results(out, handle, False, out.capacity)
            self._plain_result = (result.recv_x, result.recv_expert_idx, result.recv_weights,
                                  result.recv_src, result.tokens_per_local_expert,
                                  result.num_recv_device, None, None, None, None,
                                  result.rank_prefix_matrix, None)
            return result
        return DispatchResult(*fixed, handle, _NO_EVENT, self)

    def _plain_args(self, cls, on_current_stream: bool):
        """The reused arguments (cls: DispatchArgs or CombineArgs) of the plain calls of one
        stream."""
        on_current_stream = True if on_current_stream else False
        return self.reused_args((cls, on_current_stream), self._new_plain_args, cls,
                                on_current_stream)

    def _new_plain_args(self, cls, on_current_stream: bool):
        """_plain_args' object, its constant fields set: the plain calls check that every
        tensor is on the device (pointers_checked)."""
        a = cls()
        a.comm_stream = 0 if on_current_stream else self.comm_stream.cuda_stream
        a.pointers_checked = True
        if cls is _weft.ep.DispatchArgs:
            a.x.dtype = _BF16
            a.x.cols = self.hidden
        return a

    def launch_dispatch(self, x, is_fp8: bool, topk_idx, topk_weights, handle, stats,
                        num_sms: int, expand: Optional[Expand], sync_count: bool,
                        stream: Optional[int] = None, comm_stream: int = 0,
                        previous_event: int = 0, async_finish: bool = False,
                        hold: bool = False, count_alignment: int = 1,
                        defer_own_rows: bool = False, copy=None,
                        wait_later: bool = False) -> Union[DispatchResult, DispatchCounts]:
        """The dispatch kernel of checked inputs (x: bf16 rows, packed fp8 rows, or the fp8 pair,
        whose scales the kernel reads at their strides) on stream (default: the current one), or
        on comm_stream handed off from stream (see DispatchArgs in the binding); with hold, the
        hand-off back to stream is left to copy_out, and the result is DispatchCounts (the
        caller copies the rows out: no views of the window are made); its counts are rounded
        up to multiples of count_alignment. defer_own_rows (with hold): the rows this rank sends
        to itself get no payload in the window; copy_out(own_x=x) writes them from x.
        copy (with hold): copy_out's filled arguments (copy_out_args, set_copy_out_rows), run in
        the same extension call: right behind the kernel, or with sync_count once the count is
        out and only where it fits their num_rows (then set to the count); the result's copied
        says whether it ran (if not, the call is still held). wait_later (with sync_count and
        hold, no copy): return once the kernel is launched, the counts not read; finish_dispatch
        waits for them (they are published while the rows still move)."""
        a = _weft.ep.DispatchArgs()
        fill_token_rows(a.x, x)
        if handle is None:
            a.topk_idx = topk_idx.data_ptr()
            a.topk_idx_int64 = topk_idx.dtype == torch.int64
            a.topk_weights = topk_weights.data_ptr()
        if stats is not None:
            a.stats = stats.data_ptr()
        a.num_sms = num_sms
        if expand is not None:
            a.expand = True
            a.expert_alignment = expand.expert_alignment
            a.zero_padding = expand.zero_padding
            a.segment_stride = expand.segment_stride
        a.read_counts = bool(sync_count and handle is None)
        a.count_alignment = count_alignment
        a.stream = _current_raw_stream(self.device.index) if stream is None else stream
        a.comm_stream = comm_stream
        a.previous_event = previous_event
        a.async_finish = async_finish
        a.hold = hold
        a.defer_own_rows = defer_own_rows
        a.wait_later = wait_later
        out = self._native.dispatch(a, handle, copy)
        result_handle = NativeHandle(*out.handle)
        if handle is None:
            self.note_layout(result_handle)
        if hold:
            return DispatchCounts(result_handle, out)
        num_recv = out.num_recv if out.num_recv >= 0 else result_handle.num_recv
        return self._results(out, result_handle, is_fp8,
                             num_recv if num_recv >= 0 else out.capacity)

    def finish_dispatch(self, copy=None) -> DispatchCounts:
        """The counts of the dispatch launched with DispatchArgs.wait_later (with read_counts
        and hold: it returned once its kernel was launched, so that the caller could make its
        tensors meanwhile), a host wait, and, with copy (copy_out's filled arguments), its
        copy-out once they are out, where it fits copy's num_rows (then set to the count); the
        result's copied says whether it ran (if not, the call is still held)."""
        out = self._native.finish_dispatch(copy)
        return DispatchCounts(NativeHandle(*out.handle), out)

    def copy_out(self, num_rows: int, recv_x, *, src=None, pad_token: int = 0, topk_idx=None,
                 topk_weights=None, rank_prefix_matrix=None, stream: int = 0,
                 comm_stream: int = 0, async_finish: bool = False, own_x=None) -> None:
        """Owned copies of the latest dispatch's first num_rows rows into the given tensors (one
        kernel; rows past the count are padding, see ep::CopyOutTargets), on comm_stream (or
        stream), then the hand-off back to stream that a dispatch with hold left out. own_x:
        exactly where that dispatch deferred its own rows, its x (the payload of those rows is
        read from it)."""
        a = self.copy_out_args(src=src, pad_token=pad_token, topk_idx=topk_idx,
                               topk_weights=topk_weights, rank_prefix_matrix=rank_prefix_matrix,
                               stream=stream, comm_stream=comm_stream, async_finish=async_finish,
                               own_x=own_x)
        set_copy_out_rows(a, num_rows, recv_x)
        self._native.copy_out(a)

    @staticmethod
    def copy_out_args(*, src=None, pad_token: int = 0, topk_idx=None, topk_weights=None,
                      rank_prefix_matrix=None, stream: int = 0, comm_stream: int = 0,
                      async_finish: bool = False, own_x=None):
        """copy_out's arguments but its rows (set_copy_out_rows gives them), so that a caller
        can fill them before the count is known and launch right after it (run_copy_out)."""
        a = _weft.ep.CopyOutArgs()
        if src is not None:
            a.src = src.data_ptr()
        a.pad_token = pad_token
        if topk_idx is not None:
            a.topk_idx = topk_idx.data_ptr()
            a.topk_idx_int64 = topk_idx.dtype == torch.int64
            a.num_topk = topk_idx.shape[1]
        if topk_weights is not None:
            a.topk_weights = topk_weights.data_ptr()
            a.num_topk = topk_weights.shape[1]
        if rank_prefix_matrix is not None:
            a.rank_prefix_matrix = rank_prefix_matrix.data_ptr()
        if own_x is not None:
            a.deferred_own_rows = True
            fill_token_rows(a.own_x, own_x)
        a.stream = stream
        a.comm_stream = comm_stream
        a.async_finish = async_finish
        return a

    def run_copy_out(self, args) -> None:
        """copy_out of filled arguments (copy_out_args, then set_copy_out_rows)."""
        self._native.copy_out(args)

    # -- combine --------------------------------------------------------------------------------
    @outside_torch_function_modes
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
        if bias is None and no_event(previous_event) and not (async_finish or
                                                              allocate_on_comm_stream):
            result = self._plain_combine(expert_out, handle, out, num_sms, on_current_stream)
            if result is not None:
                return result
        num_tokens, biases = self.check_combine(expert_out, handle, bias)
        check_stream_options(previous_event, async_finish, allocate_on_comm_stream,
                             on_current_stream)
        if out is None:
            # Allocated on the caller's stream (DeepEP's default) or the comm stream.
            with torch.cuda.stream(self.comm_stream) if allocate_on_comm_stream else \
                    contextlib.nullcontext():
                out = torch.empty((num_tokens, self.hidden), dtype=torch.bfloat16,
                                  device=self.device)
        else:
            check_tensor("out", out, (torch.bfloat16,), self.device, (num_tokens, self.hidden))
        current = _current_raw_stream(self.device.index)
        if on_current_stream:
            self.launch_combine(expert_out, handle, biases, out, num_sms, current)
            return out, _NO_EVENT
        self.launch_combine(expert_out, handle, biases, out, num_sms, current,
                            self.comm_stream.cuda_stream, event_of(previous_event), async_finish)
        if not async_finish:
            return out, _NO_EVENT
        return out, async_event(self.comm_stream, [expert_out, out, *biases])

    def _plain_combine(self, expert_out, handle, out, num_sms,
                       on_current_stream) -> Optional[Tuple[torch.Tensor, EventOverlap]]:
        """The common combine (no bias, no event) with the least host work, as _plain_dispatch:
        None where the general path must run."""
        try:
            es = expert_out.shape
            d = self._device_index
            if not (expert_out.dtype is _T_BF16 and len(es) == 2 and es[1] == self.hidden and
                    expert_out.get_device() == d and expert_out.is_contiguous() and
                    type(handle) is NativeHandle and type(num_sms) is int):
                return None
            if out is None:
                out = torch.empty(handle.num_tokens, self.hidden, dtype=_T_BF16,
                                  device=self.device)
            else:
                os_ = out.shape
                if not (out.dtype is _T_BF16 and len(os_) == 2 and os_[0] == handle.num_tokens
                        and os_[1] == self.hidden and out.get_device() == d and
                        out.is_contiguous()):
                    return None
        except AttributeError:  # not tensors
            return None
        a = self._plain_args(_weft.ep.CombineArgs, on_current_stream)
        a.expert_out = expert_out.data_ptr()
        a.expert_out_rows = es[0]
        a.out = out.data_ptr()
        a.num_sms = num_sms
        a.stream = _current_raw_stream(d)
        self._native.combine(a, handle)
        return out, _NO_EVENT

    def check_combine(self, expert_out, handle, bias) -> Tuple[int, list]:
        """(num_tokens, biases) of a combine's checked arguments."""
        check_tensor("x (expert output)", expert_out, (torch.bfloat16,), self.device,
                     (None, self.hidden))
        if not isinstance(handle, NativeHandle):
            raise Error(f"handle must be a weft.ep dispatch handle, got {type(handle).__name__}")
        return handle.num_tokens, self.check_biases(handle, bias)

    def check_biases(self, handle: NativeHandle, bias) -> list:
        """The checked bias tensors of a combine (bias: None, one [T, hidden] bf16 tensor, or a
        pair of them whose members may be None, as DeepEP takes it), without the Nones."""
        biases = [] if bias is None else list(bias) if isinstance(bias, (tuple, list)) else [bias]
        if len(biases) > 2:
            raise Error(f"bias takes one tensor or a pair, got {len(biases)}")
        for i, b in enumerate(biases):
            if b is not None:
                check_tensor(f"bias[{i}]", b, (torch.bfloat16,), self.device,
                             (handle.num_tokens, self.hidden))
        return [b for b in biases if b is not None]

    def launch_combine(self, expert_out, handle, biases, out, num_sms: int,
                       stream: Optional[int] = None, comm_stream: int = 0,
                       previous_event: int = 0, async_finish: bool = False,
                       topk_weights: Optional[torch.Tensor] = None,
                       combined_weights: Optional[torch.Tensor] = None,
                       source_weights: Optional[torch.Tensor] = None) -> None:
        """The combine kernel of checked inputs (streams as in launch_dispatch). With
        topk_weights [>= num_recv, K] fp32, combined_weights [T, K] fp32 receives per token the
        fp32 sum of the weights rows of the ranks it was sent to. With source_weights
        [T, top_k] fp32 contiguous (an expanded layout, no bias), each received row counts with
        the weights of its own selections (ep::CombineInputs::source_weights)."""
        a = _weft.ep.CombineArgs()
        a.expert_out = expert_out.data_ptr()
        a.expert_out_rows = expert_out.shape[0]
        if biases:
            a.bias0 = biases[0].data_ptr()
        if len(biases) > 1:
            a.bias1 = biases[1].data_ptr()
        a.out = out.data_ptr()
        if topk_weights is not None:
            a.topk_weights = topk_weights.data_ptr()
            a.topk_weights_rows, a.topk_weights_cols = topk_weights.shape
            a.combined_weights = combined_weights.data_ptr()
        if source_weights is not None:
            a.source_weights = source_weights.data_ptr()
        a.num_sms = num_sms
        a.stream = _current_raw_stream(self.device.index) if stream is None else stream
        a.comm_stream = comm_stream
        a.previous_event = previous_event
        a.async_finish = async_finish
        self._native.combine(a, handle)
