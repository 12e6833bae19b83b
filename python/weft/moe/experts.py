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


def _grouped(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor):
    """[rows, k] x [G, n, k]^T -> [rows, n], rows grouped by expert, ends[g] (int32, on the
    device) the end of group g, ends[-1] == rows. Weights are [G, n, k] (nn.Linear's layout):
    transposed, the column-major operand grouped GEMMs take."""
    # Under torch.compile the row count is an unbacked size: assumed non-zero there (no guard),
    # which torch._grouped_mm serves as well (zero rows are an empty product).
    if guard_or_true(a.shape[0] > 0) and uses_grouped_mm(a, w):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=ends)
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist() if a.shape[0] > 0 else \
        [0] * w.shape[0]
    parts = torch.split(a, counts)
    return torch.cat([p @ w[g].t() for g, p in enumerate(parts)])


def expert_entries(recv_idx: torch.Tensor, num_local: int):
    """(entries, ends): entries the flat (row * top_k + slot) indices of every slot, those with a
    local expert first, sorted by expert (stable), then the rest; ends [num_local] int32, the end
    of each expert's group within them. Device ops only."""
    key = torch.where(recv_idx >= 0, recv_idx, num_local).flatten().long()
    entries = torch.argsort(key, stable=True)
    groups = torch.arange(num_local, device=key.device)
    ends = torch.searchsorted(key[entries], groups, right=True).to(torch.int32)
    return entries, ends


def count_entries(recv_idx: torch.Tensor) -> int:
    """The received slots with a local expert, on the host (a sync: once per layout)."""
    return int((recv_idx >= 0).sum())


def expert_ffn(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor,
               w13: torch.Tensor, w2: torch.Tensor,
               num_entries: Optional[int] = None) -> torch.Tensor:
    """w13 [local experts, 2 * ffn, hidden] (gate, then up), w2 [local experts, hidden, ffn].
    Per received row: sum over its local experts e of weight_e * FFN_e(row), in fp32, summed over
    the top-k slots by a fixed-order reduction (deterministic), in recv_x's dtype [rows, hidden].
    num_entries: the received slots with a local expert (the dispatch's count; None: counted
    here, one sync)."""
    rows, hidden = recv_x.shape
    top_k = recv_idx.shape[1]
    if num_entries is None:
        num_entries = count_entries(recv_idx)
    entries, ends = expert_entries(recv_idx, w13.shape[0])
    entries = entries[:num_entries]
    h = _grouped(recv_x[entries // top_k], w13, ends)
    gate, up = h.chunk(2, dim=1)
    y = _grouped(F.silu(gate) * up, w2, ends)
    y = y.float() * recv_w.flatten()[entries].unsqueeze(1)
    # Back to (row, slot) order, zeros for slots without a local expert; each index once, so the
    # copy is deterministic where an index_add over rows would race.
    slots = torch.zeros((rows * top_k, hidden), dtype=torch.float32, device=recv_x.device)
    slots = slots.index_copy(0, entries, y)
    return slots.view(rows, top_k, hidden).sum(dim=1).to(recv_x.dtype)
