"""The dispatchers an MoELayer runs on. Each has the same semantics (weft.ep's contract,
include/weft/ep/reference.hpp): a token goes once to every rank that hosts one of its experts;
received rows are in (source rank, source token) order with local expert ids (-1 elsewhere) and
their weights (0 elsewhere); combine sums a token's rows back in fp32 in ascending rank order and
rounds once to bf16. So the three give the same bits. A dispatch also returns num_entries, the
received (row, slot) pairs with a local expert, as a host int: the one number the experts need on
the host, read there once per layout (weft.ep's dispatch reads its per-expert counts anyway); a
worst-case dispatch (EpDispatcher with num_worst_tokens, no host sync) returns it as a 0-dim
device tensor instead.

    recv_x, recv_idx, recv_w, handle, num_entries = d.dispatch(x, topk_idx, topk_weights)
    out, combined_w = d.combine(y, handle, weights=None)
    recv_grad = d.dispatch_cached(grad_out, handle)

Each has comm_waits_on_host: whether one of its three calls (a dispatch, or its begin, a combine,
a cached dispatch) waits on the host for the device (a count or sizes read back); the
micro-batched step runs its communication on a thread of its own only for such a dispatcher
(step.default_num_threads), unless the dispatcher's one wait is for its layout
(dispatch_waits_for_layout: AllToAllDispatcher, whose sizes layout_begin counts in the router
stage) and every dispatch runs a progress after its router (step.stage_lookaheads'
dispatch_after_router, the micro-batched step's default for such a dispatcher).

A dispatch also comes in two halves, begin_dispatch(d, x, topk_idx, topk_weights).finish()
(what the micro-batched step calls: its dispatch stage begins, its experts stage finishes).
NativeEpDispatcher splits the work (its dispatch_begin launches the kernel and returns, its
finish waits for the count, published to the host while the rows move, and copies the rows
out); for a dispatcher without dispatch_begin the begin is its whole dispatch.

A dispatcher may also take its layout ahead of the dispatch: layout = d.layout_begin(topk_idx),
on the router's stream (the step's router stage calls it), then begin_dispatch(d, x, topk_idx,
topk_weights, layout). AllToAllDispatcher counts its sizes there, so that its dispatch's host wait
is for the router's work and the sizes' exchange, not for every call queued before it on the
comm stream.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from weft import Error, _weft

from .experts import count_entries


def begin_dispatch(dispatcher, x, topk_idx, topk_weights, layout=None):
    """dispatcher.dispatch_begin(...), or for a dispatcher without it (the three calls alone:
    dispatch, combine, dispatch_cached) its whole dispatch, Dispatched. layout: what the
    dispatcher's layout_begin(topk_idx) gave, if it has one (passed on as layout=)."""
    kw = {} if layout is None else {"layout": layout}
    begin = getattr(dispatcher, "dispatch_begin", None)
    if begin is None:
        return Dispatched(dispatcher.dispatch(x, topk_idx, topk_weights, **kw))
    return begin(x, topk_idx, topk_weights, **kw)


class Dispatched:
    """A dispatch that is done: finish() returns its results."""

    __slots__ = ("results",)

    def __init__(self, results) -> None:
        self.results = results

    def finish(self):
        return self.results


class LocalDispatcher:
    """One rank, every expert local, in plain torch: the reference of the others."""

    keeps_layouts = False  # a handle carries its whole layout
    comm_waits_on_host = True  # its dispatch reads the entry count (count_entries)
    num_ranks = 1
    rank = 0

    def __init__(self, num_experts: int) -> None:
        self.num_local_experts = num_experts

    def dispatch(self, x, topk_idx, topk_weights):
        valid = topk_idx >= 0
        tokens = valid.any(dim=1).nonzero().flatten()
        recv_idx = torch.where(valid, topk_idx, -1)[tokens]
        recv_w = torch.where(valid, topk_weights, torch.zeros_like(topk_weights))[tokens]
        return x[tokens], recv_idx, recv_w, (tokens, x.shape[0]), count_entries(recv_idx)

    def combine(self, y, handle, weights=None):
        # A sum of each token's one row into zeros, as the other dispatchers' (-0.0 gives +0.0).
        tokens, num_tokens = handle
        out = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        out.index_add_(0, tokens, y.float())
        combined_w = None
        if weights is not None:
            combined_w = torch.zeros((num_tokens, weights.shape[1]), dtype=weights.dtype,
                                     device=weights.device)
            combined_w.index_add_(0, tokens, weights)
        return out.bfloat16(), combined_w

    def dispatch_cached(self, x, handle):
        return x[handle[0]]


class EpDispatcher:
    """weft.ep's DeepEP-compatible Buffer (owned tensors, as training keeps them for backward).

    num_worst_tokens > 0: every dispatch returns that many rows (weft.ep's worst-case dispatch:
    the rows past the received ones have expert -1 and weight 0) and no call waits on the host,
    so the calls can be captured in a CUDA graph; num_entries is then a device tensor. weft.ep
    leaves those rows' values unwritten, as DeepEP does; here they are zeroed (one elementwise
    pass over the rows), so that every result, and every gradient through a cached dispatch, is
    deterministic."""

    keeps_layouts = True  # the Buffer's window holds the latest layout only

    def __init__(self, buffer, num_experts: int, num_worst_tokens: int = 0) -> None:
        self.buffer = buffer
        self.num_ranks = buffer.group_size
        self.rank = buffer.rank
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.num_ranks
        self.num_worst_tokens = num_worst_tokens
        # A host-synced dispatch waits for its counts; a worst-case one never waits.
        self.comm_waits_on_host = not num_worst_tokens

    def dispatch(self, x, topk_idx, topk_weights):
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx,
                                                                              self.num_experts)
        recv_x, recv_idx, recv_w, per_local_expert, handle, _ = self.buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            num_worst_tokens=self.num_worst_tokens)
        if not self.num_worst_tokens:
            # The counts are on the host once a host-synced dispatch has read its layout.
            return recv_x, recv_idx, recv_w, handle, sum(per_local_expert)
        # A received row has a local expert in some slot; a padding row in none.
        local = recv_idx >= 0
        received = local.any(dim=1, keepdim=True)
        return (torch.where(received, recv_x, 0), recv_idx, recv_w, (handle, received),
                local.sum())

    def combine(self, y, handle, weights=None):
        ep_handle = handle[0] if self.num_worst_tokens else handle
        out, combined_w, _ = self.buffer.combine(y.contiguous(), ep_handle, topk_weights=weights)
        return out, combined_w

    def dispatch_cached(self, x, handle):
        if not self.num_worst_tokens:
            recv, *_ = self.buffer.dispatch(x.contiguous(), handle=handle)
            return recv
        ep_handle, received = handle
        recv, *_ = self.buffer.dispatch(x.contiguous(), handle=ep_handle)
        return torch.where(received, recv, 0)


class NativeEpDispatcher:
    """weft.ep's native Buffer (weft.ep.NativeBuffer) with owned results, its dispatch in two
    halves: dispatch_begin launches the kernel on the current stream and returns without
    waiting (the kernel publishes the count to the host as soon as the count exchange ends,
    while the rows still move); finish() waits for that count, makes the owned tensors and
    copies the rows out on the current stream (this rank's own rows read from x, not staged in
    the window). The micro-batched step begins in its dispatch stage and finishes in its experts
    stage; on weft.pipeline at depth >= 1 that is a later progress(), so the host waits for the
    count with other micro-batches' work queued behind the dispatch, and the GPU does not drain
    at every dispatch as it does when one call waits. Results and their bits are EpDispatcher's.

    The Buffer is made at the first dispatch (hidden size and top-k come with it; with a group,
    every rank's first dispatch makes it together), for max_tokens tokens per rank and call.
    It holds one layout, its latest dispatch's: a combine or cached dispatch of an older handle
    is refused (weft.Error: the handle is stale); LayoutSlots.native_ep makes one per live
    layout. Every call runs on the current stream, the dispatcher's calls in that stream's order;
    finish() may run on another stream: it first orders that stream after the begin's, and the
    next call, on its own stream, after the finish's copy. The inputs are recorded on the streams
    that read them (Tensor.record_stream), so the caller may drop them at once. A later call on
    the dispatcher abandons a dispatch begun and not finished (its finish() then raises
    weft.Error)."""

    keeps_layouts = True  # the Buffer's window holds the latest layout only
    comm_waits_on_host = False  # the count wait is finish()'s, in the experts stage

    def __init__(self, group: Optional[dist.ProcessGroup], num_experts: int, max_tokens: int, *,
                 timeout_s: float = 20.0) -> None:
        self.group = group
        self.num_ranks = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0
        if num_experts < 1 or num_experts % self.num_ranks:
            raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the "
                             f"ranks ({self.num_ranks})")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.num_ranks
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.buffer = None  # the NativeBuffer, made at the first dispatch
        self._pending: Optional[_PendingNativeDispatch] = None
        self._begun = None  # torch.cuda.Event recorded by each begin
        self._finished = None  # recorded by a finish() on a stream other than its begin's
        self._finished_stream: Optional[int] = None  # that stream, until a call orders after it

    def _buffer_for(self, x, top_k: int):
        b = self.buffer
        if b is None:
            import weft.ep
            b = self.buffer = weft.ep.NativeBuffer(
                self.group, max_tokens=self.max_tokens, hidden=x.shape[1],
                num_experts=self.num_experts, top_k=top_k, timeout_s=self.timeout_s)
            self._begun = torch.cuda.Event()
            self._finished = torch.cuda.Event()
        elif x.shape[1] != b.hidden or top_k != b.top_k:
            raise Error(f"NativeEpDispatcher: its Buffer was made for hidden {b.hidden} and "
                        f"top-k {b.top_k}; this call has hidden {x.shape[1]} and top-k {top_k}")
        return b

    def dispatch(self, x, topk_idx, topk_weights):
        return self.dispatch_begin(x, topk_idx, topk_weights).finish()

    def dispatch_begin(self, x, topk_idx, topk_weights) -> "_PendingNativeDispatch":
        if x.dim() != 2 or topk_idx.dim() != 2:
            raise Error(f"NativeEpDispatcher: x [T, hidden] and topk_idx [T, top_k], got "
                        f"{tuple(x.shape)} and {tuple(topk_idx.shape)}")
        b = self._buffer_for(x, topk_idx.shape[1])
        num_tokens, is_fp8 = b.check_x(x)
        if is_fp8:
            raise Error("NativeEpDispatcher dispatches bf16 rows")
        b.check_selections(num_tokens, topk_idx, topk_weights)
        self._pending = None  # abandons one begun and not finished
        stream = self._ordered_stream(b)
        for t in (x, topk_idx, topk_weights):  # read by the kernel after the count is out
            t.record_stream(stream)
        b.launch_dispatch(x, False, topk_idx, topk_weights, None, None, 0, None, True,
                          hold=True, defer_own_rows=True, wait_later=True)
        self._begun.record(stream)
        self._pending = _PendingNativeDispatch(self, x, topk_idx.dtype, stream.cuda_stream)
        return self._pending

    def _finish(self, pending: "_PendingNativeDispatch"):
        if self._pending is not pending:
            raise Error("NativeEpDispatcher: this dispatch was abandoned (a later call on its "
                        "dispatcher came before its finish()), or it was finished already")
        self._pending = None
        b = self.buffer
        current = torch.cuda.current_stream(b.device)
        elsewhere = current.cuda_stream != pending.stream
        if elsewhere:
            current.wait_event(self._begun)
            pending.x.record_stream(current)  # the copy reads the own rows from x
        counts = b.finish_dispatch()
        if counts.tokens_required:
            raise Error(f"NativeEpDispatcher: a rank sent {counts.tokens_required} tokens, more "
                        f"than the Buffer's max_tokens ({b.max_tokens}); no row moved")
        n, top_k = counts.num_recv, b.top_k
        recv_x = torch.empty(n, b.hidden, dtype=torch.bfloat16, device=b.device)
        recv_idx = torch.empty(n, top_k, dtype=pending.idx_dtype, device=b.device)
        recv_w = torch.empty(n, top_k, dtype=torch.float32, device=b.device)
        b.copy_out(n, recv_x, topk_idx=recv_idx, topk_weights=recv_w,
                   stream=current.cuda_stream, own_x=pending.x)
        if elsewhere:  # the next call, on the dispatcher's stream, comes after the copy
            self._finished.record(current)
            self._finished_stream = current.cuda_stream
        return (recv_x, recv_idx, recv_w, counts.handle,
                sum(counts.tokens_per_local_expert_list))

    def _live_buffer(self):
        self._pending = None  # a later call abandons a dispatch begun and not finished
        if self.buffer is None:
            raise Error("NativeEpDispatcher: no dispatch has run (a handle comes from one)")
        self._ordered_stream(self.buffer)
        return self.buffer

    def _ordered_stream(self, b):
        """The current stream, ordered after a finish() made on another stream."""
        stream = torch.cuda.current_stream(b.device)
        if self._finished_stream is not None:
            if stream.cuda_stream != self._finished_stream:
                stream.wait_event(self._finished)
            self._finished_stream = None
        return stream

    def combine(self, y, handle, weights=None):
        b = self._live_buffer()
        y = y.contiguous()
        num_tokens, _ = b.check_combine(y, handle, None)
        out = torch.empty(num_tokens, b.hidden, dtype=torch.bfloat16, device=b.device)
        combined_w = None
        if weights is not None:
            weights = weights.contiguous()
            combined_w = torch.empty(num_tokens, weights.shape[1], dtype=torch.float32,
                                     device=b.device)
        b.launch_combine(y, handle, [], out, 0, topk_weights=weights,
                         combined_weights=combined_w)
        return out, combined_w

    def dispatch_cached(self, x, handle):
        b = self._live_buffer()
        x = x.contiguous()
        b.check_x(x)
        n = handle.num_recv  # read by the uncached dispatch's finish()
        b.launch_dispatch(x, False, None, None, handle, None, 0, None, False, hold=True,
                          defer_own_rows=True)
        recv = torch.empty(n, b.hidden, dtype=torch.bfloat16, device=b.device)
        b.copy_out(n, recv, stream=torch.cuda.current_stream(b.device).cuda_stream, own_x=x)
        return recv


class _PendingNativeDispatch:
    """NativeEpDispatcher.dispatch_begin's result: finish() gives dispatch()'s. It keeps x
    (finish() copies its own rows), the selections' dtype (the received ones') and the begin's
    stream."""

    __slots__ = ("dispatcher", "x", "idx_dtype", "stream")

    def __init__(self, dispatcher, x, idx_dtype, stream: int) -> None:
        self.dispatcher, self.x, self.idx_dtype, self.stream = dispatcher, x, idx_dtype, stream

    def finish(self):
        return self.dispatcher._finish(self)


def layout_in_torch(topk_idx, num_ranks: int, num_local_experts: int):
    """AllToAllLayout's (sizes, order, mine, send_idx) of topk_idx [T, top_k] in torch ops, on
    topk_idx's device and the current stream. The dispatcher's host time is a torch op's launch
    each, which a step pays for every call; layout_on_gpu is the same in one kernel."""
    R, epr = num_ranks, num_local_experts
    num_tokens = topk_idx.shape[0]
    dest = topk_idx.div(epr, rounding_mode="floor")  # a negative selection: a negative rank
    # [T, top_k, R]; the ranks made on this stream (a tensor kept from an earlier call might
    # be one another stream has not yet written)
    hit = dest.unsqueeze(-1) == torch.arange(R, device=topk_idx.device)
    in_rank = hit.any(dim=1)  # [T, R]
    entries = hit.sum(dim=(0, 1))
    no_rank = (topk_idx >= 0).sum() - entries.sum()  # ids >= num_experts
    sizes = torch.stack([in_rank.sum(dim=0), entries, no_rank.expand(R)], dim=1)
    # (destination, token) pairs, destination-major; a stable sort puts the set ones first
    # in that order, so that a dispatch slices the rows it sends without a count of them.
    pairs = in_rank.T.reshape(-1).view(torch.uint8)
    picked = torch.sort(pairs, descending=True, stable=True).indices
    order = picked.remainder(num_tokens)
    pair_dest = picked.div(num_tokens, rounding_mode="floor")
    mine = dest[order] == pair_dest.unsqueeze(-1)
    send_idx = torch.where(mine, topk_idx[order].remainder(epr), -1)
    return sizes, order, mine, send_idx


# The layout kernel (a CUDA build of weft) and the index dtypes it reads.
_EP = getattr(_weft, "ep", None)
_GPU_LAYOUT_DTYPES = ({torch.int64: _EP.DType.int64, torch.int32: _EP.DType.int32}
                      if hasattr(_EP, "all_to_all_layout") else {})


def can_layout_on_gpu(topk_idx, num_ranks: int) -> bool:
    """Whether layout_on_gpu takes these selections: a CUDA build of weft, int32 or int64 ids,
    a 2-D topk_idx and at most MAX_ALL_TO_ALL_LAYOUT_RANKS ranks (64: a token's destinations
    are one 64-bit mask)."""
    return (topk_idx.dtype in _GPU_LAYOUT_DTYPES and topk_idx.dim() == 2
            and topk_idx.shape[1] >= 1 and 1 <= num_ranks <= _EP.MAX_ALL_TO_ALL_LAYOUT_RANKS)


def layout_on_gpu(topk_idx, num_ranks: int, num_local_experts: int):
    """layout_in_torch's four tensors, in one kernel on the current stream (topk_idx a CUDA
    tensor that can_layout_on_gpu takes; include/weft/ep/all_to_all_layout.hpp)."""
    idx = topk_idx.contiguous()  # a copy, if made, is freed in the kernel's stream order
    num_tokens, top_k = idx.shape
    pairs = num_ranks * num_tokens
    device = idx.device
    sizes = torch.empty((num_ranks, 3), dtype=torch.int64, device=device)
    order = torch.empty(pairs, dtype=torch.int64, device=device)
    mine = torch.empty((pairs, top_k), dtype=torch.bool, device=device)
    send_idx = torch.empty((pairs, top_k), dtype=idx.dtype, device=device)
    _EP.all_to_all_layout(idx.data_ptr(), _GPU_LAYOUT_DTYPES[idx.dtype], num_tokens, top_k,
                          num_ranks, num_local_experts, sizes.data_ptr(), order.data_ptr(),
                          mine.data_ptr(), send_idx.data_ptr(),
                          torch.cuda.current_stream(device).cuda_stream, device.index)
    return sizes, order, mine, send_idx


class AllToAllLayout:
    """AllToAllDispatcher.layout_begin's result, made on the stream that was current: the
    selections it was made of (topk_idx); sizes [R, 3], per destination rank its rows, its
    entries and, in every row, this rank's selections of no rank's expert (so that every rank
    refuses them together); every (destination, token) pair in destination-major order, the
    pairs whose token has an expert at the destination first: order [R * T] (the token), mine
    [R * T, top_k] (which of its selections are that destination's) and send_idx [R * T, top_k]
    (their local expert ids, -1 elsewhere), of which a dispatch sends the first sum(rows); and
    ready, an event recorded after them (None on the CPU)."""

    __slots__ = ("topk_idx", "sizes", "order", "mine", "send_idx", "ready")

    def __init__(self, topk_idx, sizes, order, mine, send_idx, ready) -> None:
        self.topk_idx, self.sizes = topk_idx, sizes
        self.order, self.mine, self.send_idx, self.ready = order, mine, send_idx, ready


class AllToAllDispatcher:
    """The dispatcher MoE users have today: sizes exchanged with an all_to_all and read to the host
    (one wait a dispatch), rows permuted by destination, then torch.distributed.all_to_all_single
    of rows, indices and weights; combine sends the rows back the same way.

    Its layout comes in a half of its own: layout_begin(topk_idx), on the router's stream (the
    micro-batched step calls it in its router stage), counts the rows and entries per destination
    and records an event; dispatch(x, topk_idx, topk_weights, layout) exchanges those sizes on a
    stream of its own that waits for that event alone, and waits on the host for them there. So
    the dispatch's one wait ends when the router's work is done, not when every call queued
    before it on the dispatch's stream (earlier micro-batches' communication) has run. A dispatch
    without a layout makes its own; one with a layout takes only the layout of its own topk_idx
    (the same tensor). layout_group: a group of group's ranks that the sizes travel on (default:
    group). Whether the sizes' all_to_all on group waits for the rows' all_to_alls issued before
    it on the dispatch's stream is up to torch.distributed and NCCL (how they order one
    communicator's calls on two streams); on a second group of the same ranks
    (torch.distributed.new_group) it does not. Both groups' calls are issued by the dispatch
    alone, in the same order on every rank (the micro-batched step's collective tasks run in
    ticket order), which NCCL needs of two communicators in use at once."""

    keeps_layouts = False  # a handle carries its whole layout
    comm_waits_on_host = True  # the dispatch reads its sizes
    # ... counted by layout_begin in the router stage: the step puts the dispatch a progress
    # after its router (step.default_dispatch_after_router)
    dispatch_waits_for_layout = True

    def __init__(self, group: Optional[dist.ProcessGroup], num_experts: int, *,
                 layout_group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self.num_ranks = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0
        if num_experts < 1 or num_experts % self.num_ranks:
            raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the "
                             f"ranks ({self.num_ranks})")
        if layout_group is not None and (
                group is None or not isinstance(layout_group, dist.ProcessGroup)
                or dist.get_process_group_ranks(layout_group)
                != dist.get_process_group_ranks(group)):
            raise ValueError("layout_group must be a process group of group's ranks, in "
                             "group's order")
        self.layout_group = group if layout_group is None else layout_group
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.num_ranks
        self._sizes_streams = {}  # device index -> the stream the sizes are exchanged on

    def _a2a(self, send: torch.Tensor, send_split: List[int], recv_split: List[int],
             group: Optional[dist.ProcessGroup] = None):
        if self.group is None:  # one rank: its all_to_all is a copy
            return send.clone(memory_format=torch.contiguous_format)
        out = torch.empty((sum(recv_split), *send.shape[1:]), dtype=send.dtype,
                          device=send.device)
        dist.all_to_all_single(out, send.contiguous(), recv_split, send_split,
                               group=self.group if group is None else group)
        return out

    def layout_begin(self, topk_idx) -> AllToAllLayout:
        """The sizes per destination rank, its rows (tokens with an expert there) and entries
        (selections of its experts), and the rows' order and local expert ids, on the current
        stream: no wait, no collective. Made for every (destination, token) pair, R x T of them,
        not only the rows a dispatch sends (their number is known on the host only after the
        sizes' exchange): on a GPU in one kernel (layout_on_gpu), elsewhere in torch ops over
        all of the selections (layout_in_torch); the same values either way."""
        if topk_idx.is_cuda and can_layout_on_gpu(topk_idx, self.num_ranks):
            tensors = layout_on_gpu(topk_idx, self.num_ranks, self.num_local_experts)
        else:
            tensors = layout_in_torch(topk_idx, self.num_ranks, self.num_local_experts)
        ready = None
        if topk_idx.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(topk_idx.device))
        return AllToAllLayout(topk_idx, *tensors, ready)

    def _exchange_sizes(self, layout: AllToAllLayout):
        """(sent, received): the sizes sent and received, R rows each, [rows, entries, the
        sender's selections of no rank's expert] each, on the host: on the CPU at once; on a GPU
        on the sizes' own stream after layout.ready, copied to pinned memory and waited for
        there."""
        R = self.num_ranks
        ones = [1] * R

        def sent_and_received():
            return torch.cat([layout.sizes,
                              self._a2a(layout.sizes, ones, ones, self.layout_group)])
        if layout.ready is None:
            both = sent_and_received().tolist()
        else:
            device = layout.sizes.device
            stream = self._sizes_streams.get(device.index)
            if stream is None:  # as urgent as the stream it takes the wait off
                priority = torch.cuda.current_stream(device).priority
                stream = self._sizes_streams[device.index] = torch.cuda.Stream(device, priority)
            stream.wait_event(layout.ready)
            with torch.cuda.stream(stream):
                both = sent_and_received()
                host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
                host.copy_(both, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            copied.synchronize()  # the stream's work on the layout and both is done too
            both = host.tolist()
        return both[:R], both[R:]

    def dispatch(self, x, topk_idx, topk_weights, layout: Optional[AllToAllLayout] = None):
        num_tokens = x.shape[0]
        if layout is None:
            layout = self.layout_begin(topk_idx)
        elif layout.topk_idx is not topk_idx:
            raise Error("AllToAllDispatcher: the layout was made of other selections than the "
                        "dispatch's topk_idx (layout_begin(topk_idx) of the same tensor)")
        if layout.ready is not None:  # made on the router's stream, read on this one below
            for t in (layout.order, layout.mine, layout.send_idx):
                t.record_stream(torch.cuda.current_stream(t.device))
        sent, received = self._exchange_sizes(layout)
        refused = {src: bad for src, (_, _, bad) in enumerate(received) if bad}
        if refused:  # every rank has every rank's count: all refuse before any row moves
            raise Error(f"AllToAllDispatcher: topk_idx selects experts outside [0, "
                        f"{self.num_experts}) (-1 selects none): selections of no rank's expert "
                        f"per rank {refused}; no row moved")
        send_split = [rows for rows, _, _ in sent]
        recv_split = [rows for rows, _, _ in received]
        num_entries = sum(n for _, n, _ in received)
        num_rows = sum(send_split)
        order = layout.order[:num_rows]
        send_w = torch.where(layout.mine[:num_rows], topk_weights[order], 0.0)
        recv_x = self._a2a(x[order], send_split, recv_split)
        recv_idx = self._a2a(layout.send_idx[:num_rows], send_split, recv_split)
        recv_w = self._a2a(send_w, send_split, recv_split)
        return (recv_x, recv_idx, recv_w, (order, send_split, recv_split, num_tokens),
                num_entries)

    @staticmethod
    def _sum_back(rows, order, send_split, num_tokens, dtype):
        """Per token, the sum in dtype of its rows (rows [sum(send_split), ...], grouped by rank
        as order's tokens), rank by rank in ascending order: weft's reduction order. A rank's
        rows are of distinct tokens, so each index_add_ adds one value to each of its tokens."""
        out = torch.zeros((num_tokens, *rows.shape[1:]), dtype=dtype, device=rows.device)
        rows = rows.to(dtype)
        start = 0
        for n in send_split:
            out.index_add_(0, order[start:start + n], rows[start:start + n])
            start += n
        return out

    def combine(self, y, handle, weights=None):
        order, send_split, recv_split, num_tokens = handle
        back = self._a2a(y, recv_split, send_split)  # rows grouped by rank
        out = self._sum_back(back, order, send_split, num_tokens, torch.float32).bfloat16()
        combined_w = None
        if weights is not None:
            wback = self._a2a(weights, recv_split, send_split)
            combined_w = self._sum_back(wback, order, send_split, num_tokens, weights.dtype)
        return out, combined_w

    def dispatch_cached(self, x, handle):
        order, send_split, recv_split, _ = handle
        return self._a2a(x[order], send_split, recv_split)
