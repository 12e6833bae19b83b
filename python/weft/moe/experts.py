"""The experts of an MoE layer over the received rows: one SwiGLU FFN per local expert, as grouped
GEMMs whose group offsets stay on the device.

A received row carries up to top-k (expert, weight) slots; each slot with a local expert is one
*entry*. The entries are sorted by expert on the device (a stable argsort, so ties keep their
(row, slot) order), the group ends found by a binary search over the sorted keys, and both GEMMs
run as one `torch._grouped_mm` each with those device offsets. The only number the host needs is
the entry count (to size the gathered rows); the dispatchers report it with the dispatch (weft.ep
reads its per-expert counts to the host there anyway), so the experts themselves never wait for the
device. `torch._grouped_mm` (torch >= 2.8) takes bf16 (and fp32) rows, K and N whose rows are
16-byte aligned, int32 offsets; on CUDA it needs compute capability >= 9.0. Elsewhere on CUDA the
experts fall back to one matmul per expert, which reads the group sizes to the host (one sync per
call: `uses_grouped_mm` says which path a call takes).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_true


def uses_grouped_mm(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether [rows, k] x [G, n, k]^T runs as torch._grouped_mm (no host sync) here."""
    if not hasattr(torch, "_grouped_mm") or a.dtype not in (torch.bfloat16, torch.float32):
        return False
    if not a.is_cuda:
        return True
    align = 16 // a.element_size()
    return (a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device)[0] >= 9
            and a.shape[1] % align == 0 and w.shape[1] % align == 0)


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[rows, k] x [G, n, k]^T -> [rows, n], rows grouped by expert, ends[g] (int32, on the
    device) the end of group g, ends[-1] == rows. Weights are [G, n, k] (nn.Linear's layout):
    transposed, the column-major operand grouped GEMMs take (a transposed view of [G, k, n]
    weights is their own row-major layout)."""
    # Under torch.compile the row count is an unbacked size: assumed non-zero there (no guard),
    # which torch._grouped_mm serves as well (zero rows are an empty product).
    if guard_or_true(a.shape[0] > 0) and uses_grouped_mm(a, w):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=ends)
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist() if a.shape[0] > 0 else \
        [0] * w.shape[0]
    parts = torch.split(a, counts)
    return torch.cat([p @ w[g].t() for g, p in enumerate(parts)])


def grouped_weight_grad(grad: torch.Tensor, a: torch.Tensor, ends: torch.Tensor,
                        grouped: bool) -> torch.Tensor:
    """Per group g, the sum over its rows of grad_r^T a_r: [rows, n] and [rows, k] grouped as
    grouped_matmul's rows (ends) -> [G, n, k], the gradient of grouped_matmul's weights (zeros
    for an empty group). grouped: one torch._grouped_mm (the call autograd makes for
    grouped_matmul's weights); else one matmul per group (reads the group sizes to the host)."""
    num_groups = ends.shape[0]
    if grouped and a.shape[0] > 0:
        return torch._grouped_mm(grad.t(), a, offs=ends)
    if a.shape[0] == 0:
        return grad.new_zeros((num_groups, grad.shape[1], a.shape[1]))
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.stack([g.t() @ p for g, p in zip(torch.split(grad, counts),
                                                  torch.split(a, counts))])


def expert_entries(recv_idx: torch.Tensor, num_local: int):
    """(entries, ends): entries the flat (row * top_k + slot) indices of every slot, those with a
    local expert first, sorted by expert (stable), then the rest; ends [num_local] int32, the end
    of each expert's group within them. Device ops only."""
    entries, ends, _ = sorted_entries(recv_idx, num_local)
    return entries, ends


def sorted_entries(recv_idx: torch.Tensor, num_local: int):
    """(entries, ends, keys): expert_entries' two and keys, the expert of each of the entries
    (num_local for a slot without a local expert; ascending). Recv ids are in [-1, num_local):
    -1 (no local expert) maps to num_local, past every local expert. Device ops only."""
    keys, entries = torch.sort(recv_idx.flatten().long().remainder(num_local + 1), stable=True)
    groups = torch.arange(num_local, device=keys.device)
    ends = torch.searchsorted(keys, groups, right=True, out_int32=True)
    return entries, ends, keys


def count_entries(recv_idx: torch.Tensor) -> int:
    """The received slots with a local expert, on the host (a sync: once per layout)."""
    return int((recv_idx >= 0).sum())


class ExpertActivations:
    """What expert_forward kept of one call for an explicit backward (expert_backward.py): the
    entries' indices and the GEMMs' inputs and outputs, all on the device.

    entries [n] int64: the flat (row * top_k + slot) index of each entry, grouped by expert.
    rows [n] int64: entries // top_k. keys [n]: each entry's expert (ascending).
    ends [local experts] int32: the end of each expert's group. x [n, hidden]: the gathered
    rows. gate, up [n, ffn]: the first GEMM's halves. silu_gate [n, ffn]: silu(gate).
    act [n, ffn]: silu(gate) * up.
    y [n, hidden]: the second GEMM's output. weights [n] fp32: each entry's router weight.
    num_rows, top_k: recv_idx's shape. grouped: whether the GEMMs ran as torch._grouped_mm."""

    __slots__ = ("entries", "rows", "keys", "ends", "x", "gate", "up", "silu_gate", "act", "y",
                 "weights", "num_rows", "top_k", "grouped")

    def __init__(self, **fields) -> None:
        for name in self.__slots__:
            setattr(self, name, fields[name])


def expert_forward(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, num_entries: Optional[int] = None):
    """(expert_ffn's output, the ExpertActivations of the call). Under autograd the output is
    differentiable as expert_ffn's is; under no_grad the activations serve the explicit
    backward of expert_backward.py."""
    rows, hidden = recv_x.shape
    top_k = recv_idx.shape[1]
    if num_entries is None:
        num_entries = count_entries(recv_idx)
    entries, ends, keys = sorted_entries(recv_idx, w13.shape[0])
    entries, keys = entries[:num_entries], keys[:num_entries]
    entry_rows = entries // top_k
    x = recv_x[entry_rows]
    h = grouped_matmul(x, w13, ends)
    gate, up = h.chunk(2, dim=1)
    silu_gate = F.silu(gate)
    act = silu_gate * up
    y = grouped_matmul(act, w2, ends)
    grouped = uses_grouped_mm(x, w13) and uses_grouped_mm(act, w2)
    weights = recv_w.flatten()[entries].float()
    # Back to (row, slot) order, zeros for slots without a local expert; each index once, so the
    # copy is deterministic where an index_add over rows would race.
    slots = torch.zeros((rows * top_k, hidden), dtype=torch.float32, device=recv_x.device)
    slots.index_copy_(0, entries, y * weights.unsqueeze(1))  # bf16 x fp32: an fp32 product
    out = slots.view(rows, top_k, hidden).sum(dim=1).to(recv_x.dtype)
    return out, ExpertActivations(entries=entries, rows=entry_rows, keys=keys, ends=ends, x=x,
                                  gate=gate, up=up, silu_gate=silu_gate, act=act, y=y,
                                  weights=weights,
                                  num_rows=rows, top_k=top_k, grouped=grouped)


def expert_ffn(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor,
               w13: torch.Tensor, w2: torch.Tensor,
               num_entries: Optional[int] = None) -> torch.Tensor:
    """w13 [local experts, 2 * ffn, hidden] (gate, then up), w2 [local experts, hidden, ffn].
    Per received row: sum over its local experts e of weight_e * FFN_e(row), in fp32, summed over
    the top-k slots by a fixed-order reduction (deterministic), in recv_x's dtype [rows, hidden].
    num_entries: the received slots with a local expert (the dispatch's count; None: counted
    here, one sync)."""
    return expert_forward(recv_x, recv_idx, recv_w, w13, w2, num_entries)[0]
