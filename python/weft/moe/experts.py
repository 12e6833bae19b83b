"""The experts of an MoE layer over the received rows: one SwiGLU FFN per local expert, as grouped
GEMMs (torch._grouped_mm where this torch and device have it, else one matmul per expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _grouped(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list):
    """[rows, k] x [G, n, k]^T -> [rows, n], rows grouped by expert (counts[g] rows of group g,
    offsets their cumulative ends). Weights are [G, n, k] (nn.Linear's layout), which is the
    column-major operand grouped GEMMs take."""
    if a.is_cuda and hasattr(torch, "_grouped_mm") and a.dtype == torch.bfloat16 and \
            torch.cuda.get_device_capability(a.device)[0] >= 9 and a.shape[1] % 16 == 0 and \
            w.shape[1] % 16 == 0:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)
    parts = torch.split(a, counts)
    return torch.cat([p @ w[g].t() for g, p in enumerate(parts)])


def expert_ffn(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor,
               w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w13 [local experts, 2 * ffn, hidden] (gate, then up), w2 [local experts, hidden, ffn].
    Per received row: sum over its local experts e of weight_e * FFN_e(row), summed in fp32
    in top-k slot order (deterministic), as bf16 [rows, hidden]."""
    rows, hidden = recv_x.shape
    num_local = w13.shape[0]
    row, slot = (recv_idx >= 0).nonzero(as_tuple=True)
    expert = recv_idx[row, slot].long()
    order = torch.argsort(expert, stable=True)
    row, slot, expert = row[order], slot[order], expert[order]
    counts_t = torch.bincount(expert, minlength=num_local)
    counts = counts_t.tolist()
    offsets = counts_t.cumsum(0).to(torch.int32)
    h = _grouped(recv_x[row], w13, offsets, counts)
    gate, up = h.chunk(2, dim=1)
    y = _grouped(F.silu(gate) * up, w2, offsets, counts)
    y = y.float() * recv_w[row, slot].unsqueeze(1)
    acc = torch.zeros((rows, hidden), dtype=torch.float32, device=recv_x.device)
    for k in range(recv_idx.shape[1]):  # each row appears at most once per slot
        sel = (slot == k).nonzero().flatten()
        acc = acc.index_add(0, row[sel], y[sel])
    return acc.to(recv_x.dtype)
