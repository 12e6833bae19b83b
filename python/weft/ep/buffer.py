"""weft.ep.Buffer: DeepEP V1's intranode `deep_ep.Buffer`, on weft's kernels.

Code written for DeepEP runs by changing its import (`import weft.ep as deep_ep`); what differs
and why is in docs/python.md ("Migrating from DeepEP"). In short:
- weft sizes its window by tokens per call: the Buffer is built at the first dispatch from its
  shapes (hidden, top-k, experts) and the largest T whose window fits num_nvl_bytes; a later
  dispatch with other shapes rebuilds it (collectively, as every rank makes the same calls).
- Results are tensors the caller owns (copied out of the window on the comm stream).
- A handle stays usable after later dispatches (as in DeepEP), but only the latest layout is
  cheap: using an older one re-runs its layout (one extra dispatch) first; Buffer.num_relayouts
  counts those re-runs.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import Error, _weft
from . import _group
from .config import Config
from .event import EventHandle, EventOverlap
from .layout import dispatch_layout
from .native import NativeBuffer, check_tensor
from .sizing import max_tokens_for

# weft's top_k is fixed per window; DeepEP calls may pass any K up to this (or none): selections
# are padded with -1 to the Buffer's.
_MIN_TOP_K = 8
_MAX_TOP_K = 32


class Handle:
    """A dispatch's layout (DeepEP's handle tuple). handle[0] is DeepEP's rank_prefix_matrix
    [R, R] int32 (computed on first use: a collective over the group, so every rank reads it, as
    DeepEP's tests do); the other elements are weft's own and opaque."""

    def __init__(self, buffer: "Buffer", native, num_tokens: int, num_recv: Optional[int],
                 num_worst_tokens: int, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 is_token_in_rank: torch.Tensor, recv_src: torch.Tensor) -> None:
        self._buffer = buffer
        self.native = native
        self.num_tokens = num_tokens
        self.num_recv = num_recv  # None: only on the device (num_worst_tokens > 0)
        self.num_worst_tokens = num_worst_tokens
        self.topk_idx = topk_idx          # [T, window top_k], kept to re-run the layout
        self.topk_weights = topk_weights
        self.is_token_in_rank = is_token_in_rank
        self.recv_src = recv_src          # owned; padding rows of a worst-case layout: token T
        self._rank_prefix_matrix: Optional[torch.Tensor] = None

    @property
    def num_rows(self) -> int:
        """Rows of the received tensors: num_recv, or num_worst_tokens."""
        return self.num_recv if self.num_recv is not None else self.num_worst_tokens

    @property
    def rank_prefix_matrix(self) -> torch.Tensor:
        if self._rank_prefix_matrix is None:
            self._rank_prefix_matrix = self._buffer._rank_prefix_matrix(self)
        return self._rank_prefix_matrix

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        if i == 0 or i == -6:
            return self.rank_prefix_matrix
        if not -6 <= i < 6:
            raise IndexError("a dispatch handle has 6 elements")
        return (None, None, self.recv_src, self.is_token_in_rank, None)[i - 1 if i > 0 else i]

    def __iter__(self):
        return (self[i] for i in range(6))


class Buffer:
    """DeepEP's intranode Buffer over a torch.distributed NCCL group (or None: one GPU).

    Extra keyword arguments, weft's own: max_tokens (size the window for this many tokens per
    rank instead of from num_nvl_bytes), timeout_s (bound of every device-side wait).
    num_relayouts: how many times a combine or cached dispatch of an older handle re-ran that
    handle's layout (an extra dispatch each) on this Buffer.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, max_tokens: Optional[int] = None,
                 timeout_s: float = 20.0) -> None:
        if comm is not None:
            raise Error("weft.ep.Buffer takes a torch.distributed group, not an mpi4py comm")
        if low_latency_mode or num_rdma_bytes:
            raise Error("weft.ep supports DeepEP's intranode (normal) mode only: "
                        "low_latency_mode and num_rdma_bytes are not supported")
        self.rank, self.group_size = _group.group_rank_size(group)
        self.group = group
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = 0
        self.low_latency_mode = False
        self.explicitly_destroy = explicitly_destroy
        self._max_tokens = max_tokens
        self._timeout_s = timeout_s
        if max_tokens is None and self.num_nvl_bytes <= 0:
            raise Error("weft.ep.Buffer needs num_nvl_bytes > 0 (or max_tokens=...) to size its "
                        "window")
        self._native: Optional[NativeBuffer] = None
        self._layout_stream: Optional[torch.cuda.Stream] = None
        self._destroyed = False
        self.num_relayouts = 0

    # -- DeepEP's static helpers ------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise Error(f"set_num_sms: the SM count must be positive and even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (for previous_event)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 24, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 10, 256, 6, 128)

    def get_comm_stream(self) -> torch.cuda.Stream:
        return self._live("get_comm_stream").comm_stream

    def get_local_device_id(self) -> int:
        return torch.cuda.current_device()

    def destroy(self) -> None:
        if not self.explicitly_destroy:
            raise Error("destroy() needs Buffer(..., explicitly_destroy=True) (as in DeepEP)")
        if self._native is not None:
            self._native.destroy()
        self._native = None
        self._destroyed = True

    # -- the window ---------------------------------------------------------------------------
    def _live(self, what: str) -> NativeBuffer:
        if self._destroyed:
            raise Error(f"{what}: this Buffer was destroyed")
        if self._native is None:
            raise Error(f"{what}: the window is built by the first dispatch (it is sized from "
                        f"its shapes)")
        return self._native

    def _native_for(self, hidden: int, top_k: int, num_experts: int) -> NativeBuffer:
        if self._destroyed:
            raise Error("dispatch: this Buffer was destroyed")
        n = self._native
        if n is not None and n.hidden == hidden and n.num_experts == num_experts and \
                n.top_k >= top_k:
            return n
        if num_experts % self.group_size != 0:
            raise Error(f"num_experts {num_experts} must be a multiple of the group size "
                        f"{self.group_size}")
        want_k = min(max(top_k, self.group_size, _MIN_TOP_K), _MAX_TOP_K)
        if top_k > _MAX_TOP_K:
            raise Error(f"top-k {top_k} is above weft's limit of {_MAX_TOP_K}")
        max_tokens = self._max_tokens or max_tokens_for(self.num_nvl_bytes, hidden,
                                                        self.group_size, want_k, num_experts)
        if max_tokens < 1:
            raise Error(f"num_nvl_bytes={self.num_nvl_bytes} holds no token of hidden {hidden} at "
                        f"{self.group_size} ranks")
        if n is not None:
            n.destroy()
            self._native = None
        self._native = NativeBuffer(self.group, max_tokens=max_tokens, hidden=hidden,
                                    num_experts=num_experts, top_k=want_k,
                                    timeout_s=self._timeout_s)
        return self._native

    # -- layout ---------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event), as DeepEP's."""
        device = _group.current_device()
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), device, (None, None))
        if num_experts <= 0 or num_experts % self.group_size != 0:
            raise Error(f"num_experts {num_experts} must be a positive multiple of the group "
                        f"size {self.group_size}")
        if previous_event is None and not async_finish:
            per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts,
                                                            self.group_size)
            return per_rank, None, per_expert, in_rank, EventOverlap(None)
        current = torch.cuda.current_stream()
        if self._native is not None:
            side = self._native.comm_stream
        else:  # no window yet: a stream of its own, made once
            if self._layout_stream is None:
                self._layout_stream = torch.cuda.Stream(device=device, priority=-1000)
            side = self._layout_stream
        if previous_event is not None:
            side.wait_event(previous_event.event.event)
        else:
            side.wait_stream(current)
        with torch.cuda.stream(side):
            per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts,
                                                            self.group_size)
        outs = (per_rank, per_expert, in_rank)
        if not async_finish:
            current.wait_stream(side)
            return per_rank, None, per_expert, in_rank, EventOverlap(None)
        if not torch.cuda.is_current_stream_capturing():
            for t in (topk_idx, *outs):
                t.record_stream(side)
        return per_rank, None, per_expert, in_rank, EventOverlap(EventHandle(side), (topk_idx, *outs))

    # -- dispatch -------------------------------------------------------------------------------
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Handle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """DeepEP's intranode dispatch: (recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event); a cached call (handle=) returns
        (recv_x, None, None, None, None, event)."""
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if num_tokens_per_rdma_rank is not None:
            raise Error("num_tokens_per_rdma_rank: weft.ep is intranode only")
        if expert_alignment < 1:
            raise Error(f"expert_alignment must be >= 1, got {expert_alignment}")
        if num_worst_tokens < 0:
            raise Error(f"num_worst_tokens must be >= 0, got {num_worst_tokens}")
        is_fp8 = isinstance(x, (tuple, list))
        x_main = x[0] if is_fp8 else x
        if not isinstance(x_main, torch.Tensor) or x_main.dim() != 2:
            raise Error("x must be a [num_tokens, hidden] tensor or the fp8 tuple (x_e4m3, scales)")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise Error("a cached dispatch (handle=...) takes no topk_idx / topk_weights")
            return self._cached_dispatch(x, handle, config, previous_event, async_finish,
                                         allocate_on_comm_stream)
        if num_tokens_per_rank is None or is_token_in_rank is None or \
                num_tokens_per_expert is None:
            raise Error("dispatch needs num_tokens_per_rank, is_token_in_rank and "
                        "num_tokens_per_expert (from get_dispatch_layout), or a handle")
        if (topk_idx is None) != (topk_weights is None):
            raise Error("topk_idx and topk_weights go together")
        num_tokens, hidden = x_main.shape
        device = x_main.device
        num_experts = num_tokens_per_expert.numel()
        check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32,), device,
                     (num_experts,))
        check_tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32,), device,
                     (self.group_size,))
        check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,), device,
                     (num_tokens, self.group_size))
        top_k = topk_idx.shape[1] if topk_idx is not None and topk_idx.dim() == 2 else 0
        native = self._native_for(hidden, top_k, num_experts)
        if topk_idx is not None:
            check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), native.device,
                         (num_tokens, top_k))
            check_tensor("topk_weights", topk_weights, (torch.float32,), native.device,
                         (num_tokens, top_k))
        current = native._enter(previous_event, async_finish, allocate_on_comm_stream)
        comm = native.comm_stream
        k = native.top_k
        # The caller's selections go to the kernel as they are when they fit the window's top_k;
        # else (or without top-k) widened copies, made on the comm stream.
        direct = topk_idx is not None and top_k == k
        with torch.cuda.stream(comm) if is_fp8 or not direct else contextlib.nullcontext():
            if direct:
                idx_in, w_in = topk_idx, topk_weights
            else:
                idx_in, w_in = self._padded_selections(native, topk_idx, topk_weights,
                                                       is_token_in_rank)
            packed, x_dtype, x_cols, _ = native._x_arg(x)
            res = native._launch_dispatch(packed, x_dtype, x_cols, is_fp8, idx_in.data_ptr(),
                                          _index_dtype(idx_in), w_in.data_ptr(), None, 0,
                                          config.num_sms, None, num_worst_tokens == 0)
        rows = res.num_recv if num_worst_tokens == 0 else num_worst_tokens
        if rows > native.capacity:
            raise Error(f"num_worst_tokens {num_worst_tokens} is above the {native.capacity} "
                        f"rows this Buffer can receive")
        # The results belong to the caller's stream (DeepEP: allocate_on_comm_stream=False),
        # written on the comm stream, which the caller waits on (or on the event).
        with native._allocating(allocate_on_comm_stream):
            recv_x = _empty_like_rows(res.recv_x, rows)
            recv_src = torch.empty((rows, 2), dtype=torch.int32, device=device)
            recv_idx = recv_w = None
            if topk_idx is not None:
                recv_idx = torch.empty((rows, top_k), dtype=topk_idx.dtype, device=device)
                recv_w = torch.empty((rows, top_k), dtype=torch.float32, device=device)
            if direct:  # the handle's own copies, to re-run the layout whatever the caller does
                idx_keep, w_keep = torch.empty_like(topk_idx), torch.empty_like(topk_weights)
            else:
                idx_keep, w_keep = idx_in, w_in
        # One call enqueues every plain copy out of the window (and of the selections kept).
        row_bytes = native._fp8_row_bytes if is_fp8 else native.hidden * 2
        copies = [_rows_copy(dst, src, row_bytes, rows)
                  for dst, src in zip(_flat(recv_x), _flat(res.recv_x))]
        copies.append(_rows_copy(recv_src, res.recv_src, 8, rows))
        if topk_idx is not None:
            copies.append(_rows_copy(recv_w, res.recv_weights, 4 * k, rows))
            if recv_idx.dtype == torch.int32:
                copies.append(_rows_copy(recv_idx, res.recv_expert_idx, 4 * k, rows))
        if direct:
            copies += [_rows_copy(idx_keep, topk_idx, idx_keep.stride(0) * idx_keep.element_size(),
                                  num_tokens),
                       _rows_copy(w_keep, topk_weights, 4 * k, num_tokens)]
        _weft.ep.copy_rows(copies, comm.cuda_stream, native.device.index)
        needs_ops = (topk_idx is not None and recv_idx.dtype != torch.int32) or \
            num_worst_tokens > 0
        with torch.cuda.stream(comm) if needs_ops else contextlib.nullcontext():
            if topk_idx is not None and recv_idx.dtype != torch.int32:
                recv_idx.copy_(res.recv_expert_idx[:rows, :top_k])  # widened to int64
            if num_worst_tokens > 0:
                invalid = torch.arange(rows, device=device, dtype=torch.int32) >= \
                    res.num_recv_device
                recv_src[:, 1].masked_fill_(invalid, num_tokens)
                if topk_idx is not None:
                    recv_idx.masked_fill_(invalid[:, None], -1)
                    recv_w.masked_fill_(invalid[:, None], 0)
        if num_worst_tokens > 0:
            counts: List[int] = []
        elif topk_idx is not None:
            counts = [-(-c // expert_alignment) * expert_alignment
                      for c in res.tokens_per_local_expert_list]
        else:
            counts = self._counts_without_topk(num_tokens_per_expert, expert_alignment)
        new_handle = Handle(self, res.handle, num_tokens,
                            res.num_recv if num_worst_tokens == 0 else None, num_worst_tokens,
                            idx_keep, w_keep, is_token_in_rank, recv_src)
        outs = [t for t in (packed, idx_keep, w_keep, topk_idx, topk_weights, *_flat(recv_x),
                            recv_idx, recv_w, recv_src, *_flat(x)) if t is not None]
        event = native._leave(current, async_finish, outs)
        return recv_x, recv_idx, recv_w, counts, new_handle, event

    def _padded_selections(self, native: NativeBuffer, topk_idx, topk_weights, is_token_in_rank):
        """topk_idx / topk_weights widened with -1 / 0 to the window's top_k, as int64. Without
        top-k (routing by is_token_in_rank alone) each destination rank gets one selection of
        its first expert."""
        num_tokens = is_token_in_rank.shape[0]
        k = native.top_k
        idx = torch.full((num_tokens, k), -1, dtype=torch.int64, device=native.device)
        w = torch.zeros((num_tokens, k), dtype=torch.float32, device=native.device)
        if topk_idx is not None:
            idx[:, :topk_idx.shape[1]].copy_(topk_idx)
            w[:, :topk_weights.shape[1]].copy_(topk_weights)
        else:
            first = torch.arange(self.group_size, device=native.device) * native.num_local_experts
            idx[:, :self.group_size].copy_(torch.where(is_token_in_rank, first, -1))
        return idx, w

    def _counts_without_topk(self, num_tokens_per_expert: torch.Tensor, alignment: int) -> list:
        total = num_tokens_per_expert.clone()
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        mine = total.view(self.group_size, -1)[self.rank].tolist()
        return [-(-c // alignment) * alignment for c in mine]

    def _relayout(self, native: NativeBuffer, handle: Handle, x=None, config=None):
        """Re-runs the layout of an older handle (one uncached dispatch of its selections) so
        that the window holds it again; returns that dispatch's result."""
        if x is None:
            x = torch.zeros((handle.num_tokens, native.hidden), dtype=torch.bfloat16,
                            device=native.device)
        packed, x_dtype, x_cols, is_fp8 = native._x_arg(x)
        res = native._launch_dispatch(packed, x_dtype, x_cols, is_fp8,
                                      handle.topk_idx.data_ptr(), _index_dtype(handle.topk_idx),
                                      handle.topk_weights.data_ptr(), None, 0,
                                      (config or self.get_dispatch_config(self.group_size)).num_sms,
                                      None, False)
        handle.native = res.handle
        self.num_relayouts += 1
        return res, packed

    def _native_of(self, handle, what: str) -> NativeBuffer:
        """The window a call with handle runs on; raises unless handle is this Buffer's."""
        if not isinstance(handle, Handle):
            raise Error(f"handle must come from this Buffer's dispatch, got "
                        f"{type(handle).__name__}")
        native = self._live(what)
        if handle._buffer is not self:
            raise Error("handle comes from another Buffer")
        return native

    def _cached_dispatch(self, x, handle, config, previous_event, async_finish,
                         allocate_on_comm_stream):
        native = self._native_of(handle, "dispatch")
        current = native._enter(previous_event, async_finish, allocate_on_comm_stream)
        rows = handle.num_rows
        current_layout = native._holds_layout(handle.native)
        plain = current_layout and not isinstance(x, (tuple, list))  # no torch op on the way
        with contextlib.nullcontext() if plain else torch.cuda.stream(native.comm_stream):
            if current_layout:
                packed, x_dtype, x_cols, is_fp8 = native._x_arg(x)
                res = native._launch_dispatch(packed, x_dtype, x_cols, is_fp8, 0, "int64", 0,
                                              handle.native, 0, config.num_sms, None, False)
            else:
                res, packed = self._relayout(native, handle, x, config)
        with native._allocating(allocate_on_comm_stream):
            recv_x = _empty_like_rows(res.recv_x, rows)
        row_bytes = native._fp8_row_bytes if isinstance(recv_x, tuple) else native.hidden * 2
        _weft.ep.copy_rows([_rows_copy(dst, src, row_bytes, rows)
                            for dst, src in zip(_flat(recv_x), _flat(res.recv_x))],
                           native.comm_stream.cuda_stream, native.device.index)
        event = native._leave(current, async_finish, [packed, *_flat(recv_x), *_flat(x)])
        return recv_x, None, None, None, None, event

    # -- combine --------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: Handle,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's intranode combine (a sum, without weights): (combined_x [T, hidden] bf16,
        combined_topk_weights [T, K] fp32 or None, event)."""
        config = self.get_combine_config(self.group_size) if config is None else config
        native = self._native_of(handle, "combine")
        rows = handle.num_rows
        check_tensor("x", x, (torch.bfloat16,), native.device, (None, native.hidden))
        if x.shape[0] < rows:
            raise Error(f"x has {x.shape[0]} rows, but the dispatch of this handle received "
                        f"{rows}")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, (torch.float32,), native.device,
                         (x.shape[0], None))
        biases = [] if bias is None else list(bias) if isinstance(bias, (tuple, list)) else [bias]
        if len(biases) > 2:
            raise Error(f"bias takes one tensor or a pair, got {len(biases)}")
        for i, b in enumerate(biases):
            if b is not None:
                check_tensor(f"bias[{i}]", b, (torch.bfloat16,), native.device,
                             (handle.num_tokens, native.hidden))
        biases = [b for b in biases if b is not None]
        current = native._enter(previous_event, async_finish, allocate_on_comm_stream)
        keep = [x, *biases]
        with native._allocating(allocate_on_comm_stream):
            out = torch.empty((handle.num_tokens, native.hidden), dtype=torch.bfloat16,
                              device=native.device)
        plain = native._holds_layout(handle.native) and topk_weights is None
        with contextlib.nullcontext() if plain else torch.cuda.stream(native.comm_stream):
            if not native._holds_layout(handle.native):
                _, packed = self._relayout(native, handle, None, config)
                keep.append(packed)
            native._launch_combine(x, handle.native, biases, out, config.num_sms)
            combined_w = None
            if topk_weights is not None:
                combined_w = self._combine_weights(topk_weights[:rows], handle, native,
                                                   allocate_on_comm_stream)
        keep += [out] + ([combined_w] if combined_w is not None else [])
        event = native._leave(current, async_finish, keep)
        return out, combined_w, event

    def _combine_weights(self, weights: torch.Tensor, handle: Handle, native: NativeBuffer,
                         allocate_on_comm_stream: bool) -> torch.Tensor:
        """Per source token, the sum of the weights rows of the ranks it was sent to (DeepEP's
        combined_topk_weights), exact in fp32. Across ranks this is one all_to_all over the
        group, with the split sizes read to the host."""
        num_tokens, k = handle.num_tokens, weights.shape[1]
        with native._allocating(allocate_on_comm_stream):
            out = torch.zeros((num_tokens + 1, k), dtype=torch.float32, device=weights.device)
        src = handle.recv_src
        if self.group_size == 1:
            out.index_add_(0, src[:, 1].long(), weights)
            return out[:num_tokens]
        valid = src[:, 1] < num_tokens
        send_rows = weights[valid]
        send_split = torch.bincount(src[valid, 0].long(), minlength=self.group_size).tolist()
        recv_split = handle.is_token_in_rank.sum(dim=0).tolist()
        received = torch.empty((sum(recv_split), k), dtype=torch.float32, device=weights.device)
        dist.all_to_all_single(received, send_rows.contiguous(), recv_split, send_split,
                               group=self.group)
        tokens = torch.cat([handle.is_token_in_rank[:, r].nonzero().flatten()
                            for r in range(self.group_size)])
        out.index_add_(0, tokens, received)
        return out[:num_tokens]

    def _rank_prefix_matrix(self, handle: Handle) -> torch.Tensor:
        """rank_prefix_matrix[i][j]: rows rank j received from ranks 0..i."""
        src = handle.recv_src
        valid = src[:, 1] < handle.num_tokens
        mine = torch.zeros(self.group_size + 1, dtype=torch.int32, device=src.device)
        slot = torch.where(valid, src[:, 0].long(), self.group_size)
        mine.scatter_add_(0, slot, torch.ones_like(slot, dtype=torch.int32))
        column = mine[:self.group_size].cumsum(0, dtype=torch.int32)
        if self.group_size == 1:
            return column.view(1, 1)
        columns = torch.empty((self.group_size, self.group_size), dtype=torch.int32,
                              device=src.device)
        dist.all_gather_into_tensor(columns, column, group=self.group)
        return columns.t().contiguous()


def _index_dtype(t: torch.Tensor) -> str:
    return "int64" if t.dtype == torch.int64 else "int32"


def _rows_copy(dst: torch.Tensor, src: torch.Tensor, src_pitch: int, rows: int):
    """A copy_rows entry: rows rows of dst's (contiguous) width from src, whose rows are
    src_pitch bytes apart."""
    width = dst.stride(0) * dst.element_size() if dst.dim() > 1 else dst.element_size()
    return (dst.data_ptr(), width, src.data_ptr(), src_pitch, width, rows)


def _empty_like_rows(x, rows: int):
    """Empty tensors of x's (or the fp8 pair's) row width and dtype, with rows rows."""
    if isinstance(x, tuple):
        return tuple(torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in x)
    return torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)


def _flat(x):
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
