"""DeepEP's low-latency API (`low_latency_dispatch` / `low_latency_combine`) on weft's expanded
dispatch with fixed-stride segments (Expand.segment_stride) and its weighted combine.

    buf = weft.ep.Buffer(group, num_rdma_bytes=weft.ep.Buffer.get_low_latency_rdma_size_hint(
        M, hidden, num_ranks, num_experts), low_latency_mode=True)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, M, num_experts)
    y = experts(recv_x, recv_count)           # [E_local, M * R, hidden]
    out, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

Layout (every shape fixed by M = num_max_dispatch_tokens_per_rank, R ranks, E_local experts per
rank, so that one CUDA graph serves every step): rank d's expert e receives its rows at
[e, 0 .. recv_count[e]) of a [E_local, M * R, row] array, in (source rank, source token) order,
the rest of the segment padding. It is the expanded layout of weft's dispatch with segment e at
row e * M * R (no second protocol, no copy of the rows).

One call into C++ per dispatch (_weft.ep.Buffer.low_latency_dispatch, after the argument checks
here) and one kernel: the expanded dispatch of x, with use_fp8 each token cast once (DeepEP's
per-128 cast, round_scale: power-of-two scales) into packed fp8 rows before they go out, and at
its end, once the rows have arrived, src_info, layout_range and the scales in DeepEP's layouts
(fp32 column-major, or the UE8M0 exponent bytes) written into the slot's tensors (received
rows' scales only). No torch op runs in the call (async_finish or the hook record one event):
recv_x, recv_count and the handle's tensors are made once per slot. x must be 16-byte aligned
(rows move as 16-byte vectors; the cast reads it so too).

Double buffering (DeepEP's rule that a call's results stay valid for the two latest calls): two
windows (slots) alternate per dispatch; a dispatch's results (recv_x, recv_count, the handle's
tensors) live in its slot and stay valid until the dispatch after the next one. A combine must
use the handle of one of the two latest dispatches: an older one is refused (weft.Error), not
combined from overwritten rows.

Streams: a plain call (async_finish=False, return_recv_hook=False) runs on the current stream
itself, after the Buffer's previous low-latency call (of either window) if that ran on another
stream, which must still exist (torch's streams do). With
async_finish=True the call runs on the Buffer's comm stream after the current stream's work and
the returned EventOverlap orders it; with return_recv_hook=True likewise, and hook() makes the
current stream wait for the arrivals (weft's dispatch and combine are one kernel each, so the
hook waits for that kernel rather than launching a receive kernel).
"""

from __future__ import annotations

import socket
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import Error, _weft
from . import _group
from .event import EventHandle, EventOverlap
from .native import _NO_EVENT, NativeBuffer, NativeHandle, _current_raw_stream, check_tensor
from .sizing import window_bytes_for

_FP8_GROUP = 128
# The top-k the size hint assumes (its per-row metadata grows with it): the most weft takes.
_HINT_TOP_K = 32
_NUM_SLOTS = 2


def window_bytes(num_max_tokens: int, hidden: int, num_ranks: int, num_experts: int,
                 top_k: int) -> int:
    """Bytes of the low-latency windows of one rank (both slots)."""
    return _NUM_SLOTS * window_bytes_for(num_max_tokens, hidden, num_ranks, top_k, num_experts,
                                         num_experts // num_ranks)


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                   num_experts: int) -> int:
    check_shapes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    return window_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts,
                        _HINT_TOP_K)


def refuse_internode(group) -> None:
    """weft.Error unless every rank of group runs on this host (collective over group)."""
    if group is None:
        return
    hosts = [None] * group.size()
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        raise Error(f"Buffer(low_latency_mode=True): the group spans {len(set(hosts))} hosts; "
                    f"weft.ep's low-latency mode is intranode (NVLink) only")


def check_shapes(num_max_tokens, hidden, num_ranks: int, num_experts) -> None:
    for name, v in (("num_max_dispatch_tokens_per_rank", num_max_tokens), ("hidden", hidden),
                    ("num_experts", num_experts)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise Error(f"low-latency mode: {name} must be an int >= 1, got {v!r}")
    if num_experts % num_ranks != 0:
        raise Error(f"low-latency mode: num_experts {num_experts} must be a multiple of the "
                    f"number of ranks {num_ranks}")
    if hidden % 8 != 0:
        raise Error(f"low-latency mode: hidden {hidden} must be a multiple of 8 (rows move as "
                    f"16-byte vectors)")


def _plain_combine_inputs(x, topk_idx, topk_weights, x_shape, topk_shape, device_index) -> bool:
    """Whether a combine's tensors are of the accepted case (x bf16 x_shape, topk_idx int64 or
    int32 and topk_weights fp32 topk_shape, all contiguous on the device), checked with the least
    host work; False also for what is not a tensor (check_tensor then names what is wrong)."""
    try:
        idx_dtype = topk_idx.dtype
        return (x.dtype is torch.bfloat16 and topk_weights.dtype is torch.float32 and
                (idx_dtype is torch.int64 or idx_dtype is torch.int32) and
                x.shape == x_shape and topk_idx.shape == topk_shape and
                topk_weights.shape == topk_shape and x.get_device() == device_index and
                topk_idx.get_device() == device_index and
                topk_weights.get_device() == device_index and x.is_contiguous() and
                topk_idx.is_contiguous() and topk_weights.is_contiguous())
    except AttributeError:  # not tensors
        return False


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle: (src_info [E_local, M * R] int32: the source token of each
    received row, -1 for padding; layout_range [E_local, R] int64: per (local expert, source
    rank) begin << 32 | count of its rows in the segment; M; hidden; num_experts)."""

    def __new__(cls, src_info: torch.Tensor, layout_range: torch.Tensor, num_max_tokens: int,
                hidden: int, num_experts: int, owner: "_Slot", serial: int, native,
                num_tokens: int, num_topk: int) -> "LowLatencyHandle":
        h = super().__new__(cls, (src_info, layout_range, num_max_tokens, hidden, num_experts))
        h.owner, h.serial, h.native = owner, serial, native
        h.num_tokens, h.num_topk = num_tokens, num_topk
        return h


class _Slot:
    """One of the two windows, with the persistent tensors of its results and the fixed
    arguments of its binding calls."""

    def __init__(self, native: NativeBuffer, num_max_tokens: int) -> None:
        self.native = native
        self.serial = -1  # the number of the latest dispatch laid out here
        r, e, h = native.num_ranks, native.num_local_experts, native.hidden
        self.stride = num_max_tokens * r
        dev = native.device
        self.src_info = torch.empty((e, self.stride), dtype=torch.int32, device=dev)
        self.layout_range = torch.empty((e, r), dtype=torch.int64, device=dev)
        self.no_weights = torch.zeros((num_max_tokens, native.top_k), dtype=torch.float32,
                                      device=dev)
        g = h // _FP8_GROUP
        # DeepEP's scale layouts: column-major in the last two dims.
        self.scales = torch.empty_strided((e, self.stride, g), (self.stride * g, 1, self.stride),
                                          dtype=torch.float32, device=dev) if h % _FP8_GROUP == 0 \
            else None
        self.ue8m0 = torch.empty_strided((e, self.stride, g // 4),
                                         (self.stride * (g // 4), 1, self.stride),
                                         dtype=torch.int32, device=dev) \
            if h % (4 * _FP8_GROUP) == 0 else None
        self.combine_buffer: Optional[torch.Tensor] = None
        # The views of the window that every call of this slot returns (recv_x bf16, the fp8
        # payload, recv_count), made at the slot's first call of each kind.
        self.recv_bf16: Optional[torch.Tensor] = None
        self.recv_q: Optional[torch.Tensor] = None
        self.recv_count: Optional[torch.Tensor] = None
        a = _weft.ep.LowLatencySlot()
        a.topk_weights = self.no_weights.data_ptr()
        a.segment_stride = self.stride
        a.src_info = self.src_info.data_ptr()
        a.layout_range = self.layout_range.data_ptr()
        a.scales = 0 if self.scales is None else self.scales.data_ptr()
        a.ue8m0 = 0 if self.ue8m0 is None else self.ue8m0.data_ptr()
        a.comm_stream = native.comm_stream.cuda_stream
        self.args = a

    def views(self, out, use_fp8: bool):
        """(recv_x, recv_count) of the slot's window (made once per kind of call)."""
        n = self.native
        if self.recv_count is None or (self.recv_q if use_fp8 else self.recv_bf16) is None:
            res = n._results(out, NativeHandle(*out.handle), use_fp8, out.capacity)
            rows = n.num_local_experts * self.stride
            shape = (n.num_local_experts, self.stride, n.hidden)
            if use_fp8:
                self.recv_q = res.recv_x[0][:rows].view(shape)
            else:
                self.recv_bf16 = res.recv_x[:rows].view(shape)
            self.recv_count = res.tokens_per_local_expert
        return (self.recv_q if use_fp8 else self.recv_bf16), self.recv_count


class LowLatency:
    """The low-latency state of one weft.ep.Buffer: its two slots, laid out at the first call
    for the call's shapes (M, hidden, num_experts, top-k) and again, on every rank alike, when
    they change."""

    def __init__(self, buffer) -> None:
        self._buffer = buffer
        self._slots: List[_Slot] = []
        self._shapes: Optional[Tuple[int, int, int, int]] = None
        self._num_dispatches = 0
        # The binding's flag bits (fp8, round_scale, ue8m0, on the comm stream, after the
        # previous call's stream), read at the first layout (a build without CUDA has none).
        self._flags: Tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
        # The stream (cudaStream_t) of the latest low-latency call of either window: the next
        # call runs after its work (every rank runs the windows' kernels in one order).
        self._previous_stream: Optional[int] = None

    def destroy(self) -> None:
        for s in self._slots:
            s.native.destroy()
        self._slots = []
        self._shapes = None

    # -- windows ----------------------------------------------------------------------------
    def _lay_out(self, num_max_tokens: int, hidden: int, num_experts: int, top_k: int) -> None:
        shapes = (num_max_tokens, hidden, num_experts, top_k)
        if self._shapes == shapes:
            return
        b = self._buffer
        # Every rank must lay out the same windows (NCCL registers them collectively): a rank
        # whose call has other shapes is named here instead of hanging the registration.
        _group.share(b.group, None, ("low-latency windows", shapes))
        need = window_bytes(num_max_tokens, hidden, b.group_size, num_experts, top_k)
        if b.num_rdma_bytes and need > b.num_rdma_bytes:
            raise Error(f"low-latency mode: num_rdma_bytes={b.num_rdma_bytes} is below the "
                        f"{need} bytes of two windows of M={num_max_tokens}, hidden={hidden}, "
                        f"{num_experts} experts, top-{top_k} at {b.group_size} ranks; size it "
                        f"with Buffer.get_low_latency_rdma_size_hint")
        self.destroy()
        e = _weft.ep
        self._flags = (e.LOW_LATENCY_FP8, e.LOW_LATENCY_ROUND_SCALE, e.LOW_LATENCY_UE8M0,
                       e.LOW_LATENCY_ON_COMM, e.LOW_LATENCY_AFTER)
        for _ in range(_NUM_SLOTS):
            native = NativeBuffer(b.group, max_tokens=num_max_tokens, hidden=hidden,
                                  num_experts=num_experts, top_k=top_k,
                                  expand_factor=num_experts // b.group_size,
                                  timeout_s=b._timeout_s, communicator=b._communicator,
                                  comm_stream=b._comm_stream)
            self._slots.append(_Slot(native, num_max_tokens))
        self._shapes = shapes

    # -- dispatch -----------------------------------------------------------------------------
    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                 round_scale, use_ue8m0, async_finish, return_recv_hook):
        b = self._buffer
        device = b._device
        m = num_max_dispatch_tokens_per_rank
        shapes = self._plain_shapes(x, topk_idx, m, num_experts)
        if shapes is None:  # not the windows' shapes, or not the accepted case: the full checks
            shapes = self._check_inputs(x, topk_idx, m, num_experts)
        num_tokens, hidden, num_topk = shapes
        if dispatch_wait_recv_cost_stats is not None:
            raise Error("low_latency_dispatch(dispatch_wait_recv_cost_stats=...): weft.ep does "
                        "not measure per-rank wait times; pass None")
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                         (torch.int32,), device, (num_experts // b.group_size,))
        if use_ue8m0 and not round_scale:
            raise Error("low_latency_dispatch(use_ue8m0=True) needs round_scale=True (UE8M0 "
                        "scales are powers of two)")
        if (round_scale or use_ue8m0) and not use_fp8:
            raise Error("low_latency_dispatch: round_scale / use_ue8m0 need use_fp8=True")
        if use_fp8 and hidden % _FP8_GROUP != 0:
            raise Error(f"low_latency_dispatch(use_fp8=True) needs hidden a multiple of "
                        f"{_FP8_GROUP}, got {hidden}")
        if use_ue8m0 and hidden % (4 * _FP8_GROUP) != 0:
            raise Error(f"low_latency_dispatch(use_ue8m0=True) packs 4 scales per int32: hidden "
                        f"must be a multiple of {4 * _FP8_GROUP}, got {hidden}")
        self._lay_out(m, hidden, num_experts, num_topk)
        serial = self._num_dispatches
        slot = self._slots[serial % _NUM_SLOTS]
        native = slot.native
        # One call, one kernel: the dispatch (fp8: each token cast before its rows go out) and
        # the layout of its results into the slot's tensors.
        waits = async_finish or return_recv_hook
        fp8, round_, ue8m0, on_comm, after = self._flags
        previous = self._previous_stream
        flags = ((fp8 if use_fp8 else 0) | (round_ if round_scale else 0) |
                 (ue8m0 if use_ue8m0 else 0) | (on_comm if waits else 0) |
                 (0 if previous is None else after))
        stats = cumulative_local_expert_recv_stats
        stream = _current_raw_stream(device.index)
        out = native._native.low_latency_dispatch(
            slot.args, x.data_ptr(), num_tokens, topk_idx.data_ptr(),
            topk_idx.dtype is torch.int64, 0 if stats is None else stats.data_ptr(), stream,
            previous or 0, flags)
        self._previous_stream = slot.args.comm_stream if waits else stream
        native_handle = out.handle
        recv_q, recv_count = slot.recv_q if use_fp8 else slot.recv_bf16, slot.recv_count
        if recv_q is None or recv_count is None:
            recv_q, recv_count = slot.views(out, use_fp8)
        if use_fp8:
            recv_x = (recv_q, slot.ue8m0 if use_ue8m0 else slot.scales)
        else:
            recv_x = recv_q
        slot.serial = serial
        self._num_dispatches += 1
        handle = LowLatencyHandle(slot.src_info, slot.layout_range, m, hidden, num_experts,
                                  slot, serial, native_handle, num_tokens, num_topk)
        if not waits:
            return recv_x, recv_count, handle, _NO_EVENT, None
        keep = [x, topk_idx, stats]
        event, hook = self._finish(async_finish, return_recv_hook, keep)
        return recv_x, recv_count, handle, event, hook

    def _plain_shapes(self, x, topk_idx, num_max_tokens, num_experts):
        """(num_tokens, hidden, num_topk) where x and topk_idx are of the accepted case for the
        windows laid out already (their shapes were checked then), checked with the least host
        work; else None."""
        shapes = self._shapes
        if shapes is None:
            return None
        d = self._buffer._device.index
        try:
            xs, ks = x.shape, topk_idx.shape
            idx_dtype = topk_idx.dtype
            if not (x.dtype is torch.bfloat16 and len(xs) == 2 and len(ks) == 2 and
                    ks[0] == xs[0] <= num_max_tokens and
                    (idx_dtype is torch.int64 or idx_dtype is torch.int32) and
                    shapes == (num_max_tokens, xs[1], num_experts, ks[1]) and
                    type(num_max_tokens) is int and type(num_experts) is int and
                    x.get_device() == d and topk_idx.get_device() == d and
                    x.is_contiguous() and topk_idx.is_contiguous()):
                return None
        except AttributeError:  # not tensors
            return None
        return xs[0], xs[1], ks[1]

    def _check_inputs(self, x, topk_idx, num_max_tokens, num_experts):
        """(num_tokens, hidden, num_topk) of a dispatch's x and topk_idx; raises weft.Error for
        what is wrong."""
        b = self._buffer
        check_tensor("x", x, (torch.bfloat16,), b._device, (None, None))
        num_tokens, hidden = x.shape
        check_shapes(num_max_tokens, hidden, b.group_size, num_experts)
        if num_tokens > num_max_tokens:
            raise Error(f"low_latency_dispatch: x has {num_tokens} tokens, above "
                        f"num_max_dispatch_tokens_per_rank={num_max_tokens}")
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), b._device,
                     (num_tokens, None))
        num_topk = topk_idx.shape[1]
        if not 1 <= num_topk <= 32:
            raise Error(f"low_latency_dispatch: topk_idx has {num_topk} columns; 1..32 allowed")
        return num_tokens, hidden, num_topk

    # -- combine ------------------------------------------------------------------------------
    def _slot_of(self, handle, what: str) -> _Slot:
        if not isinstance(handle, LowLatencyHandle):
            raise Error(f"{what}: handle must be a low_latency_dispatch handle, got "
                        f"{type(handle).__name__}")
        slot = handle.owner
        slots = self._slots  # none, or the _NUM_SLOTS == 2 windows
        if not slots or (slot is not slots[0] and slot is not slots[-1]):
            raise Error(f"{what}: the handle is of windows laid out for other shapes (or of "
                        f"another Buffer)")
        if slot.serial != handle.serial:
            raise Error(f"{what}: the handle is of low-latency dispatch {handle.serial}, but "
                        f"dispatch {slot.serial} has reused its window since: results stay valid "
                        f"for the two latest dispatches only")
        return slot

    def next_combine_buffer(self, handle) -> torch.Tensor:
        slot = self._slot_of(handle, "get_next_low_latency_combine_buffer")
        if slot.combine_buffer is None:
            n = slot.native
            slot.combine_buffer = torch.empty((n.num_local_experts, slot.stride, n.hidden),
                                              dtype=torch.bfloat16, device=n.device)
        return slot.combine_buffer

    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                return_recv_hook, out, combine_wait_recv_cost_stats):
        b = self._buffer
        device = b._device
        if use_logfmt:
            raise Error("low_latency_combine(use_logfmt=True): weft.ep combines bf16 rows only "
                        "(no LogFMT)")
        if combine_wait_recv_cost_stats is not None:
            raise Error("low_latency_combine(combine_wait_recv_cost_stats=...): weft.ep does "
                        "not measure per-rank wait times; pass None")
        slot = self._slot_of(handle, "low_latency_combine")
        native = slot.native
        shape = (native.num_local_experts, slot.stride, native.hidden)
        t, k = handle.num_tokens, handle.num_topk
        if not _plain_combine_inputs(x, topk_idx, topk_weights, shape, (t, k), device.index):
            check_tensor("x", x, (torch.bfloat16,), device, shape)
            check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), device, (t, k))
            check_tensor("topk_weights", topk_weights, (torch.float32,), device, (t, k))
        if zero_copy:
            if slot.combine_buffer is None:
                raise Error("low_latency_combine(zero_copy=True) needs the rows written into "
                            "get_next_low_latency_combine_buffer(handle) first")
            expert_out = slot.combine_buffer
        else:
            expert_out = x  # contiguous (checked above)
        if out is None:
            out = x.new_empty((t, native.hidden))  # bf16 on the device, as x (fewer arguments)
        elif not (type(out) is torch.Tensor and out.dtype is torch.bfloat16 and
                  out.shape == (t, native.hidden) and out.get_device() == device.index and
                  out.is_contiguous()):
            check_tensor("out", out, (torch.bfloat16,), device, (t, native.hidden))
        # One call, one kernel: on the current stream (plain) or the comm stream.
        plain = not async_finish and not return_recv_hook
        previous = self._previous_stream
        stream = _current_raw_stream(device.index)
        native._native.low_latency_combine(
            slot.args, expert_out.data_ptr(), shape[0] * shape[1],  # expert_out's rows
            topk_weights.data_ptr(), out.data_ptr(), handle.native, stream, previous or 0,
            (0 if plain else self._flags[3]) | (0 if previous is None else self._flags[4]))
        self._previous_stream = stream if plain else slot.args.comm_stream
        if plain:
            return out, _NO_EVENT, None
        keep = [x, expert_out, topk_idx, topk_weights, out]
        event, hook = self._finish(async_finish, return_recv_hook, keep)
        return out, event, hook

    # -- streams ------------------------------------------------------------------------------
    def _finish(self, async_finish: bool, return_recv_hook: bool,
                keep) -> Tuple[EventOverlap, Optional[Callable[[], None]]]:
        """The completion of a call made with async_finish or return_recv_hook, which ran on the
        comm stream (a plain call runs on the current stream itself): the EventOverlap or the
        hook waits for the comm stream; keep's tensors live until then."""
        done = EventHandle(self._buffer._comm_stream)
        tensors = [t for t in keep if isinstance(t, torch.Tensor)]
        event = EventOverlap(done, tensors) if async_finish else _NO_EVENT
        hook = None
        if return_recv_hook:
            held = [tensors]

            def hook() -> None:
                done.current_stream_wait()
                held.clear()

        return event, hook
