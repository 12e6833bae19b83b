"""A training step of several MoE layers with a dense block between them (bf16), the workload of
weft's MoE benchmarks and tests.

    model = MoEModel(num_layers=2, hidden=2048, num_experts=128, top_k=8, ffn=768,
                     dispatcher=EpDispatcher(buffer, 128), device="cuda")
    loss = train_step(model, x, target, lr=1e-3)
"""

from __future__ import annotations

import math

import torch

from .layer import MoELayer


class DenseBlock(torch.nn.Module):
    """x + W2 gelu(W1 x): the dense work between two MoE layers."""

    def __init__(self, hidden: int, device=None, dtype=torch.bfloat16, seed: int = 0) -> None:
        super().__init__()
        device = torch.device("cpu" if device is None else device)
        g = torch.Generator(device=device).manual_seed(seed)
        self.w1 = torch.nn.Parameter((torch.randn((hidden, 2 * hidden), generator=g,
                                                  device=device) / math.sqrt(hidden)).to(dtype))
        self.w2 = torch.nn.Parameter((torch.randn((2 * hidden, hidden), generator=g,
                                                  device=device) / math.sqrt(2 * hidden)).to(dtype))

    def forward(self, x):
        return x + torch.nn.functional.gelu(x @ self.w1) @ self.w2


class MoEModel(torch.nn.Module):
    """num_layers x (dense block, then MoE layer with a residual)."""

    def __init__(self, num_layers: int, hidden: int, num_experts: int, top_k: int, ffn: int,
                 dispatcher, device=None, dtype=torch.bfloat16, seed: int = 0) -> None:
        super().__init__()
        self.dense = torch.nn.ModuleList(
            [DenseBlock(hidden, device, dtype, seed + 2 * i) for i in range(num_layers)])
        self.moe = torch.nn.ModuleList(
            [MoELayer(hidden, num_experts, top_k, ffn, dispatcher, device, dtype, seed + 2 * i + 1)
             for i in range(num_layers)])

    def forward(self, x):
        for dense, moe in zip(self.dense, self.moe):
            x = dense(x)
            x = x + moe(x)
        return x


def train_step(model: MoEModel, x: torch.Tensor, target: torch.Tensor, lr: float) -> torch.Tensor:
    """One step of plain SGD on the mean squared error; returns the loss (fp32, on the device)."""
    for p in model.parameters():
        p.grad = None
    loss = (model(x).float() - target.float()).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(lr * p.grad)
    return loss.detach()
