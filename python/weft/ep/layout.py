"""get_dispatch_layout in torch: what DeepEP's layout kernel returns, computed with a few
device-side scatters (no host sync, CUDA-graph capturable)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                    out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank
    [T, R] bool) of topk_idx [T, K] (-1 = no selection; ids outside [0, E) count nowhere),
    written into out when given (tensors the caller allocated where it wants them owned; the
    temporaries live on the current stream)."""
    num_tokens = topk_idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < num_experts)
    # Invalid selections go to a spill column that is dropped.
    expert_slot = torch.where(valid, idx, num_experts).flatten()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    per_expert.scatter_add_(0, expert_slot, torch.ones_like(expert_slot))
    rank_slot = torch.where(valid, idx // experts_per_rank, num_ranks)
    in_rank = torch.zeros((num_tokens, num_ranks + 1), dtype=torch.bool, device=idx.device)
    in_rank.scatter_(1, rank_slot, True)
    if out is None:
        is_token_in_rank = in_rank[:, :num_ranks].contiguous()
        return is_token_in_rank.sum(dim=0, dtype=torch.int32), per_expert[:num_experts].int(), \
            is_token_in_rank
    per_rank_out, per_expert_out, in_rank_out = out
    in_rank_out.copy_(in_rank[:, :num_ranks])
    torch.sum(in_rank_out, dim=0, dtype=torch.int32, out=per_rank_out)
    per_expert_out.copy_(per_expert[:num_experts])
    return per_rank_out, per_expert_out, in_rank_out
