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
    """DeepEP's per-token fp8 cast as its tests write it (tests/utils.py), run by torch on x's
    device: (x_e4m3 [T, H], scales fp32 [T, H / 128]). torch computes 448.0 / amax as
    reciprocal(amax) * 448 everywhere, and amax / 448.0 as amax * (1 / 448) on the GPU but as a
    quotient on the CPU: weft's cast (cast_fp8 below) is this on the GPU."""
    t, h = x.shape
    g = x.float().view(t, h // 128, 128)
    amax = g.abs().amax(dim=2).clamp(min=1e-4)
    q = (g * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn)
    return q.view(t, h), amax / 448.0


def cast_fp8(x: torch.Tensor, round_scale: bool):
    """What weft's fp8 cast (ep::cast_to_fp8, types.hpp) writes, in torch ops that give the same
    bits on every device: (e4m3 [T, H], scales fp32 [T, H / 128] row-major). Per group of 128, in
    fp32: amax = max(|x|, 1e-4), NaN elements not counted; scale = amax * (1 / 448) (round_scale:
    the next power of two at or above it, exact), q = e4m3(x * (1 / amax * 448)) (round_scale:
    x * (1 / scale), exact), saturated to +-448 (NaN codes aside: torch's may carry a sign)."""
    num_tokens, hidden = x.shape
    g = x.view(num_tokens, hidden // 128, 128).float()
    magnitude = g.abs()
    amax = magnitude.masked_fill_(magnitude.isnan(), 0.0).amax(dim=-1).clamp_(min=1e-4)
    scale = amax * (1.0 / 448.0)
    if round_scale:
        scale = power_of_two_at_or_above(scale)
        q = g * scale.reciprocal().unsqueeze(-1)
    else:
        q = g * (amax.reciprocal() * 448.0).unsqueeze(-1)
    q = q.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(num_tokens, hidden)
    return q, scale


def power_of_two_at_or_above(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) of positive normal fp32 values, by their bits (exact on every device)."""
    bits = v.view(torch.int32)
    return ((bits + 0x7FFFFF) & -0x800000).view(torch.float32)