"""MoELayer: router top-k, dispatch, the experts (grouped GEMMs), combine weighted by the router;
forward and backward through any dispatcher of dispatchers.py."""

from __future__ import annotations

import math
from typing import Tuple

import torch

from . import ops
from .experts import expert_ffn


class _Dispatch(torch.autograd.Function):
    """Forward: dispatch. Backward: the rows' gradients combined back to their tokens (a sum over
    the ranks a token went to, as the forward copied it there), the weights' likewise."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, dispatcher):
        recv_x, recv_idx, recv_w, handle, num_entries = dispatcher.dispatch(x, topk_idx,
                                                                            topk_weights)
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, handle, num_entries

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w, _grad_idx, _grad_handle, _grad_num_entries):
        grad_x, grad_w = ctx.dispatcher.combine(grad_recv_x, ctx.handle,
                                                weights=grad_recv_w.contiguous())
        return grad_x, grad_w, None, None


class _Combine(torch.autograd.Function):
    """Forward: combine. Backward: the output's gradient dispatched again over the same layout
    (a cached dispatch): each row's gradient is its token's."""

    @staticmethod
    def forward(ctx, y, handle, dispatcher):
        ctx.dispatcher, ctx.handle = dispatcher, handle
        out, _ = dispatcher.combine(y, handle)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return ctx.dispatcher.dispatch_cached(grad_out.contiguous(), ctx.handle), None, None


def dispatch(x, topk_idx, topk_weights, dispatcher):
    """Differentiable dispatch: (recv_x, recv_weights, recv_expert_idx, handle, num_entries)."""
    return _Dispatch.apply(x, topk_weights, topk_idx, dispatcher)


def combine(y, handle, dispatcher):
    """Differentiable combine: [T, hidden] bf16."""
    return _Combine.apply(y, handle, dispatcher)


class MoELayer(torch.nn.Module):
    """y = combine(sum over a row's local experts e of w_e * FFN_e(row)); the router is a linear
    layer, softmax over experts, top-k. This rank holds the experts
    [rank * E/R, (rank + 1) * E/R) of the dispatcher's ranks.

    Under torch.compile the layer calls the dispatcher through the custom ops of ops.py (one
    graph, no break, given torch._dynamo.config.capture_scalar_outputs and
    capture_dynamic_output_shape_ops: the received rows and the entry count are unbacked sizes);
    eagerly it calls it through _Dispatch and _Combine. Both give the same bits."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, ffn: int, dispatcher,
                 device=None, dtype=torch.bfloat16, seed: int = 0) -> None:
        super().__init__()
        self.hidden, self.num_experts, self.top_k, self.ffn = hidden, num_experts, top_k, ffn
        self.dispatcher = dispatcher  # registered with the ops (the property below)
        num_local = num_experts // dispatcher.num_ranks
        first = dispatcher.rank * num_local
        device = torch.device("cpu" if device is None else device)

        def draw(shape, fan_in, stream_seed):
            # On the parameters' device (a DeepSeek-V3 layer holds 11G expert weights); each
            # expert from its own seed, so that a model at any number of ranks holds the same.
            g = torch.Generator(device=device).manual_seed(stream_seed)
            return (torch.randn(shape, generator=g, device=device) / math.sqrt(fan_in)).to(dtype)

        self.router = torch.nn.Parameter(draw((hidden, num_experts), hidden, seed * 100003))
        self.w13 = torch.nn.Parameter(torch.stack(
            [draw((2 * ffn, hidden), hidden, seed * 100003 + 1 + 2 * e)
             for e in range(first, first + num_local)]))
        self.w2 = torch.nn.Parameter(torch.stack(
            [draw((hidden, ffn), ffn, seed * 100003 + 2 + 2 * e)
             for e in range(first, first + num_local)]))

    @property
    def dispatcher(self):
        return self._dispatcher

    @dispatcher.setter
    def dispatcher(self, dispatcher) -> None:
        # The ops name a dispatcher by an int, which torch.compile specialises as a constant.
        self._dispatcher, self._dispatcher_id = dispatcher, ops.register(dispatcher)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self.dispatcher = self._dispatcher  # a copy (deepcopy, unpickling) names its own

    def route(self, x) -> Tuple[torch.Tensor, torch.Tensor]:
        scores = (x @ self.router).float().softmax(dim=1)
        weights, idx = scores.topk(self.top_k, dim=1)
        return idx, weights

    def forward(self, x):
        idx, weights = self.route(x)
        if torch.compiler.is_compiling():
            return self._forward_ops(x, idx, weights)
        recv_x, recv_w, recv_idx, handle, num_entries = dispatch(x, idx, weights, self.dispatcher)
        y = expert_ffn(recv_x, recv_idx, recv_w, self.w13, self.w2, num_entries)
        return combine(y, handle, self.dispatcher)

    def _forward_ops(self, x, idx, weights):
        recv_x, recv_w, recv_idx, handle, count = ops.dispatch(x, idx, weights,
                                                               self._dispatcher_id)
        # The entry count sizes the experts' gathered rows: an unbacked SymInt, bounded by the
        # received slots (which lets the slice entries[:num_entries] keep that size).
        num_entries = count.item()
        torch._check(num_entries >= 0)
        torch._check(num_entries <= recv_idx.shape[0] * recv_idx.shape[1])
        y = expert_ffn(recv_x, recv_idx, recv_w, self.w13, self.w2, num_entries)
        return ops.combine(y, handle, self._dispatcher_id, x.shape[0])
