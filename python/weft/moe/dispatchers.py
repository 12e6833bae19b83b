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
(step.default_num_threads).

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

from weft import Error

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
        tokens, num_tokens = handle
        out = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        out[tokens] = y.float()
        combined_w = None
        if weights is not None:
            combined_w = torch.zeros((num_tokens, weights.shape[1]), dtype=weights.dtype,
                                     device=weights.device)
            combined_w[tokens] = weights
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


class AllToAllLayout:
    """AllToAllDispatcher.layout_begin's result: the selections it was made of (topk_idx), which
    of them are valid ([T, top_k]), which tokens go to which rank (in_rank [T, R]) and the sizes
    per destination (sizes [R, 2]: rows, entries), made on the stream that was current, and
    ready, an event recorded there after them (None on the CPU)."""

    __slots__ = ("topk_idx", "valid", "in_rank", "sizes", "ready")

    def __init__(self, topk_idx, valid, in_rank, sizes, ready) -> None:
        self.topk_idx, self.valid, self.in_rank = topk_idx, valid, in_rank
        self.sizes, self.ready = sizes, ready


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

    def __init__(self, group: Optional[dist.ProcessGroup], num_experts: int, *,
                 layout_group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self.num_ranks = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0
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
        out = torch.empty((sum(recv_split), *send.shape[1:]), dtype=send.dtype,
                          device=send.device)
        if self.group is None:
            out.copy_(send)
        else:
            dist.all_to_all_single(out, send.contiguous(), recv_split, send_split,
                                   group=self.group if group is None else group)
        return out

    def layout_begin(self, topk_idx) -> AllToAllLayout:
        """Per destination rank, its rows (tokens with an expert there) and entries (selections of
        its experts), on the current stream; no wait, no collective."""
        R, epr = self.num_ranks, self.num_local_experts
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // epr, R)
        in_rank = torch.zeros((topk_idx.shape[0], R + 1), dtype=torch.bool,
                              device=topk_idx.device)
        in_rank.scatter_(1, dest, True)
        in_rank = in_rank[:, :R]
        dests = dest.flatten()
        entries = torch.zeros(R + 1, dtype=torch.int64, device=topk_idx.device)
        entries.scatter_add_(0, dests, torch.ones_like(dests))
        sizes = torch.stack([in_rank.sum(0), entries[:R]], dim=1)
        ready = None
        if sizes.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(sizes.device))
        return AllToAllLayout(topk_idx, valid, in_rank, sizes, ready)

    def _exchange_sizes(self, layout: AllToAllLayout) -> List[List[int]]:
        """The sizes sent (R rows) then received (R rows), [rows, entries] each, on the host: on
        the CPU at once; on a GPU on the sizes' own stream after layout.ready, copied to pinned
        memory and waited for there."""
        ones = [1] * self.num_ranks

        def sent_and_received():
            return torch.cat([layout.sizes,
                              self._a2a(layout.sizes, ones, ones, self.layout_group)])
        if layout.ready is None:
            return sent_and_received().tolist()
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
        copied.synchronize()  # the stream's work on layout.sizes and both is done too
        return host.tolist()

    def dispatch(self, x, topk_idx, topk_weights, layout: Optional[AllToAllLayout] = None):
        R = self.num_ranks
        num_tokens = x.shape[0]
        if layout is None:
            layout = self.layout_begin(topk_idx)
        elif layout.topk_idx is not topk_idx:
            raise Error("AllToAllDispatcher: the layout was made of other selections than the "
                        "dispatch's topk_idx (layout_begin(topk_idx) of the same tensor)")
        valid, in_rank = layout.valid, layout.in_rank
        if in_rank.is_cuda:  # made on the router's stream, read on this one below
            for t in (valid, in_rank):
                t.record_stream(torch.cuda.current_stream(t.device))
        host = self._exchange_sizes(layout)
        send_split = [rows for rows, _ in host[:R]]
        recv_split = [rows for rows, _ in host[R:]]
        num_entries = sum(n for _, n in host[R:])
        # Rows grouped by destination, tokens ascending within each: in_rank's set entries in
        # (destination, token) order, by a stable sort (no second sync for their number).
        flat = torch.logical_not(in_rank.T.reshape(-1)).to(torch.int8)
        picked = torch.argsort(flat, stable=True)[:sum(send_split)]
        order = picked % num_tokens
        rows_dest = picked // num_tokens
        send_tokens = list(order.split(send_split))
        epr = self.num_local_experts
        local = (topk_idx[order] // epr == rows_dest[:, None]) & valid[order]
        send_idx = torch.where(local, topk_idx[order] - rows_dest[:, None] * epr, -1)
        send_w = torch.where(local, topk_weights[order], torch.zeros_like(topk_weights[order]))
        recv_x = self._a2a(x[order], send_split, recv_split)
        recv_idx = self._a2a(send_idx, send_split, recv_split)
        recv_w = self._a2a(send_w, send_split, recv_split)
        return (recv_x, recv_idx, recv_w, (send_tokens, send_split, recv_split, num_tokens),
                num_entries)

    def combine(self, y, handle, weights=None):
        send_tokens, send_split, recv_split, num_tokens = handle
        back = self._a2a(y.contiguous(), recv_split, send_split)  # rows grouped by rank
        out = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        start = 0
        for d, tokens in enumerate(send_tokens):  # ascending rank: weft's reduction order
            out[tokens] += back[start:start + len(tokens)].float()
            start += len(tokens)
        combined_w = None
        if weights is not None:
            wback = self._a2a(weights.contiguous(), recv_split, send_split)
            combined_w = torch.zeros((num_tokens, weights.shape[1]), dtype=weights.dtype,
                                     device=weights.device)
            start = 0
            for tokens in send_tokens:
                combined_w[tokens] += wback[start:start + len(tokens)]
                start += len(tokens)
        return out.bfloat16(), combined_w

    def dispatch_cached(self, x, handle):
        send_tokens, send_split, recv_split, _ = handle
        return self._a2a(x[torch.cat(send_tokens)], send_split, recv_split)
