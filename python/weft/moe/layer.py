"""MoELayer: router top-k, dispatch, the experts (grouped GEMMs), combine weighted by the router;
forward and backward through any dispatcher of dispatchers.py."""

from __future__ import annotations

import math
from typing import Tuple

import torch

from .experts import expert_ffn


class _Dispatch(torch.autograd.Function):
    """Forward: dispatch. Backward: the rows' gradients combined back to their tokens (a sum over
    the ranks a token went to, as the forward copied it there), the weights' likewise."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, dispatcher):
        recv_x, recv_idx, recv_w, handle = dispatcher.dispatch(x, topk_idx, topk_weights)
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, handle

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w, _grad_idx, _grad_handle):
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
    """Differentiable dispatch: (recv_x, recv_weights, recv_expert_idx, handle)."""
    return _Dispatch.apply(x, topk_weights, topk_idx, dispatcher)


def combine(y, handle, dispatcher):
    """Differentiable combine: [T, hidden] bf16."""
    return _Combine.apply(y, handle, dispatcher)


class MoELayer(torch.nn.Module):
    """y = combine(sum over a row's local experts e of w_e * FFN_e(row)); the router is a linear
    layer, softmax over experts, top-k. This rank holds the experts
    [rank * E/R, (rank + 1) * E/R) of the dispatcher's ranks."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, ffn: int, dispatcher,
                 device=None, dtype=torch.bfloat16, seed: int = 0) -> None:
        super().__init__()
        self.hidden, self.num_experts, self.top_k, self.ffn = hidden, num_experts, top_k, ffn
        self.dispatcher = dispatcher
        num_local = num_experts // dispatcher.num_ranks
        g = torch.Generator().manual_seed(seed)
        router = torch.randn((hidden, num_experts), generator=g) / math.sqrt(hidden)
        # Every rank draws all experts with the same generator and keeps its own, so that a
        # model at any number of ranks holds the same parameters.
        w13 = torch.randn((num_experts, 2 * ffn, hidden), generator=g) / math.sqrt(hidden)
        w2 = torch.randn((num_experts, hidden, ffn), generator=g) / math.sqrt(ffn)
        first = dispatcher.rank * num_local
        self.router = torch.nn.Parameter(router.to(device=device, dtype=dtype))
        self.w13 = torch.nn.Parameter(w13[first:first + num_local].to(device=device, dtype=dtype)
                                      .contiguous())
        self.w2 = torch.nn.Parameter(w2[first:first + num_local].to(device=device, dtype=dtype)
                                     .contiguous())

    def route(self, x) -> Tuple[torch.Tensor, torch.Tensor]:
        scores = (x @ self.router).float().softmax(dim=1)
        weights, idx = scores.topk(self.top_k, dim=1)
        return idx, weights

    def forward(self, x):
        idx, weights = self.route(x)
        recv_x, recv_w, recv_idx, handle = dispatch(x, idx, weights, self.dispatcher)
        y = expert_ffn(recv_x, recv_idx, recv_w, self.w13, self.w2)
        return combine(y, handle, self.dispatcher)
