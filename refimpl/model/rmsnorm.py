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
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
