"""The CPU reference of weft.ep (include/weft/ep/reference.hpp's contract, in torch), and the
inputs the GPU tests draw."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class Received:
    x: torch.Tensor          # [n, H] (bf16, or packed uint8 rows)
    expert_idx: torch.Tensor  # [n, K] int32 local expert or -1
    weights: torch.Tensor    # [n, K] fp32, 0 where not local
    src: torch.Tensor        # [n, 2] int32 (source rank, source token)
    tokens_per_local_expert: torch.Tensor  # [E / R] int32


def dispatch(xs: List[torch.Tensor], idxs: List[torch.Tensor], ws: List[torch.Tensor],
             num_experts: int) -> List[Received]:
    """What each rank receives when rank s sends xs[s] with idxs[s] / ws[s] (CPU tensors)."""
    num_ranks = len(xs)
    epr = num_experts // num_ranks
    out = []
    for d in range(num_ranks):
        parts = []
        for s in range(num_ranks):
            idx = idxs[s].long()
            local = (idx >= d * epr) & (idx < (d + 1) * epr)
            tokens = local.any(dim=1).nonzero().flatten()
            parts.append((
                xs[s][tokens],
                torch.where(local, idx - d * epr, -1)[tokens].int(),
                torch.where(local, ws[s], torch.zeros_like(ws[s]))[tokens],
                torch.stack([torch.full_like(tokens, s), tokens], dim=1).int()))
        x, e, w, src = (torch.cat([p[i] for p in parts]) for i in range(4))
        per_expert = torch.stack([(e == j).any(dim=1).sum() for j in range(epr)]).int()
        out.append(Received(x, e, w, src, per_expert))
    return out


def combine(received: List[Received], expert_outs: List[torch.Tensor], num_tokens: List[int],
            biases: Optional[List[List[torch.Tensor]]] = None) -> List[torch.Tensor]:
    """Each source rank's combine output: bf16(((0 + b0) + b1) + sum over d ascending of the
    rows of its tokens at d), every addition in fp32."""
    num_ranks = len(received)
    hidden = expert_outs[0].shape[1]
    outs = []
    for s in range(num_ranks):
        acc = torch.zeros((num_tokens[s], hidden), dtype=torch.float32)
        for b in (biases[s] if biases else []):
            acc = acc + b.float()
        for d in range(num_ranks):
            rows = (received[d].src[:, 0] == s).nonzero().flatten()
            tokens = received[d].src[rows, 1].long()
            acc[tokens] = acc[tokens] + expert_outs[d][rows].float()
        outs.append(acc.bfloat16())
    return outs


def random_routing(num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator,
                   mask_fraction: float = 0.1) -> torch.Tensor:
    """Distinct experts per token (top-k of random scores), a fraction of selections -1."""
    scores = torch.rand((num_tokens, num_experts), generator=generator)
    idx = scores.topk(top_k, dim=1).indices
    masked = torch.rand((num_tokens, top_k), generator=generator) < mask_fraction
    return torch.where(masked, -1, idx)


def per_token_cast_to_fp8(x: torch.Tensor):
    """DeepEP's per-token fp8 cast (types.hpp): (x_e4m3 [T, H], scales fp32 [T, H / 128]).
    amax / 448 as the product amax * (1 / 448), which is what torch computes on the GPU (on the
    CPU it divides)."""
    t, h = x.shape
    g = x.float().view(t, h // 128, 128)
    amax = g.abs().amax(dim=2).clamp(min=1e-4)
    q = (g * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn)
    return q.view(t, h), amax * (1.0 / 448.0)
