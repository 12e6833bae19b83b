"""The HSTU step's dense model: HSTU-like layers over padded jagged sequences and an MLP head,
trained with a sampled softmax against shared negatives.

One layer (pointwise attention, as HSTU): ``u, v, q, k = silu(W_uvqk · norm(x))`` split per
head; ``a = (silu(q kᵀ) ⊙ mask / L) v`` with a causal mask that also hides padding;
``x + W_o · (norm(a) ⊙ u)``. The head is ``Linear -> GELU -> Linear``; position ``t`` of a
history predicts its item at ``t + 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HstuLayer", "HstuModel"]


class HstuLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * inner)
        self.norm_attn = nn.LayerNorm(inner)
        self.out = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, L, dim); mask (B, 1, L, L), 1 where query t may see key s."""
        b, l, _ = x.shape
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).chunk(4, dim=-1)
        q, k, v = (t.reshape(b, l, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in (q, k, v))
        scores = F.silu(q @ k.transpose(-1, -2)) * (mask / l)
        a = (scores @ v).transpose(1, 2).reshape(b, l, -1)
        return x + self.out(self.norm_attn(a) * u)


class HstuModel(nn.Module):
    def __init__(self, dim: int, max_seq_len: int, num_layers: int, num_heads: int,
                 head_dim: int, mlp_dim: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(max_seq_len, dim) * 0.02)
        self.layers = nn.ModuleList(HstuLayer(dim, num_heads, head_dim)
                                    for _ in range(num_layers))
        self.head = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x (B, L, dim) embeddings, zero at padding; valid (B, L) bool. Returns (B, L, dim)."""
        l = x.shape[1]
        causal = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
        mask = (causal & valid[:, None, :])[:, None].to(x.dtype)
        x = x + self.pos
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)

    @staticmethod
    def loss_sum(out: torch.Tensor, target: torch.Tensor, target_valid: torch.Tensor,
                 negatives: torch.Tensor) -> torch.Tensor:
        """Sampled softmax summed over the valid targets (fp32): out and target (N, dim),
        target_valid (N,) bool, negatives (K, dim) shared by every position."""
        out = F.normalize(out.float(), dim=-1)
        pos = (out * F.normalize(target.float(), dim=-1)).sum(-1, keepdim=True)
        neg = out @ F.normalize(negatives.float(), dim=-1).T
        logits = torch.cat([pos, neg], dim=-1) * 20.0
        per_position = torch.logsumexp(logits, dim=-1) - logits[:, 0]
        return (per_position * target_valid).sum()
