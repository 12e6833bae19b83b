"""The experts' backward without autograd, cut in two: the data gradient (dgrad: the received
rows' and router weights' gradients, which the backward communication sends back) per
micro-batch, and the weight gradient (wgrad) of w13 and w2 once per step over all of the step's
micro-batches.

expert_dgrad takes the ExpertActivations of expert_forward (run under no_grad) and the gradient
of its output; besides the two row gradients it returns the micro-batch's WgradInputs (the
GEMMs' inputs and their output gradients, grouped by expert). ExpertWgrad collects those in
micro-batch order and, at the step's end, sorts every micro-batch's entries by expert (stable:
within an expert, micro-batch order, then the entries' own order) and runs one grouped GEMM per
weight over all of them: one fp32-accumulated sum per weight element, rounded once, where
accumulating per micro-batch would write and re-read each weight's whole gradient M times.

    out, act = expert_forward(recv_x, recv_idx, recv_w, w13, w2, num_entries)  # under no_grad
    grad_x, grad_w, inputs = expert_dgrad(grad_out, act, w13, w2)
    wgrad.add(inputs)                          # micro-batch 0, 1, ... in order
    grad_w13, grad_w2 = wgrad.compute()        # once per step
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .experts import ExpertActivations, grouped_matmul, grouped_weight_grad


class WgradInputs:
    """One micro-batch's operands of the experts' weight gradients, grouped by expert (keys
    ascending, ends their group ends): x [n, hidden] and grad_h [n, 2 * ffn] (the first GEMM's
    input and output gradient), act [n, ffn] and grad_y [n, hidden] (the second's). All made on
    the stream the experts run on."""

    __slots__ = ("keys", "ends", "x", "grad_h", "act", "grad_y", "grouped")

    def __init__(self, keys, ends, x, grad_h, act, grad_y, grouped) -> None:
        self.keys, self.ends, self.x, self.grad_h = keys, ends, x, grad_h
        self.act, self.grad_y, self.grouped = act, grad_y, grouped


def expert_dgrad(grad_out: torch.Tensor, a: ExpertActivations, w13: torch.Tensor,
                 w2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, WgradInputs]:
    """grad_out [rows, hidden]: the gradient of expert_forward's output. Returns (grad recv_x
    [rows, hidden] in grad_out's dtype, grad recv_w [rows, top_k] fp32, the WgradInputs). Each
    row's gradient is the sum over its top-k slots in fp32, by a fixed-order reduction
    (the reduction's accumulator; deterministic: one index per slot, no atomics); slots
    without a local expert get zero.
    Device ops only (the grouped GEMMs take the device offsets)."""
    rows, top_k = a.num_rows, a.top_k
    g = grad_out[a.rows]                                  # each entry's output gradient
    grad_w_e = (g.float() * a.y).sum(dim=1)               # d out / d weight, fp32
    grad_y = (g * a.weights.unsqueeze(1)).to(grad_out.dtype)
    grad_act = grouped_matmul(grad_y, w2.transpose(-2, -1), a.ends)
    grad_up = grad_act * a.silu_gate
    grad_gate = torch.ops.aten.silu_backward(grad_act * a.up, a.gate)
    grad_h = torch.cat([grad_gate, grad_up], dim=1)
    grad_x_e = grouped_matmul(grad_h, w13.transpose(-2, -1), a.ends)
    slots = grad_out.new_zeros((rows * top_k, grad_out.shape[1]))
    slots.index_copy_(0, a.entries, grad_x_e)
    grad_x = slots.view(rows, top_k, -1).sum(dim=1)   # accumulated in fp32, rounded once
    grad_w = torch.zeros(rows * top_k, dtype=torch.float32, device=grad_out.device)
    grad_w.index_copy_(0, a.entries, grad_w_e)
    return grad_x, grad_w.view(rows, top_k), WgradInputs(a.keys, a.ends, a.x, grad_h, a.act,
                                                         grad_y, a.grouped)


class ExpertWgrad:
    """The expert weight gradients of one layer over one step: add() each micro-batch's
    WgradInputs in micro-batch order, compute() once after the last. The result depends only on
    what was added and in which order, not on when: so a serial step and a pipelined one that
    add the same micro-batches in the same order get the same bits."""

    def __init__(self) -> None:
        self._inputs: List[WgradInputs] = []

    @property
    def num_micro_batches(self) -> int:
        return len(self._inputs)

    def add(self, inputs: WgradInputs) -> None:
        self._inputs.append(inputs)

    def compute(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(grad w13 [experts, 2 * ffn, hidden], grad w2 [experts, hidden, ffn]) of every
        added micro-batch, in the weights' dtype; empties the collection."""
        inputs, self._inputs = self._inputs, []
        if not inputs:
            raise ValueError("ExpertWgrad.compute: no micro-batch was added")
        first = inputs[0]
        if len(inputs) == 1:
            x, grad_h, act, grad_y, ends = first.x, first.grad_h, first.act, first.grad_y, \
                first.ends
        else:
            keys, order = torch.sort(torch.cat([i.keys for i in inputs]), stable=True)
            groups = torch.arange(first.ends.shape[0], device=keys.device)
            ends = torch.searchsorted(keys, groups, right=True, out_int32=True)
            x, grad_h, act, grad_y = (
                torch.cat([getattr(i, name) for i in inputs]).index_select(0, order)
                for name in ("x", "grad_h", "act", "grad_y"))
        grouped = all(i.grouped for i in inputs)
        return (grouped_weight_grad(grad_h, x, ends, grouped),
                grouped_weight_grad(grad_y, act, ends, grouped))
