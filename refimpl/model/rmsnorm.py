"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"): Llama's norm.

    y = x / sqrt(mean(x²) + eps) · g"""
from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / sqrt(mean(x²) + eps), computed in at least fp32, returned in x's dtype."""
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return (wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)
