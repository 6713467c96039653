"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"): Llama's norm.

    y = x / sqrt(mean(x²) + eps) · g

LayerNorm without the mean subtraction and without a bias: one h-vector of gains per norm. The
statistic is taken in at least float32 (a bf16 sum of h squares loses the small ones); float64
stays float64, where Hugging Face's and Meta's code compute in float32 whatever the input (in a
float64 run that is a downcast: tests/test_llama_hf.py says how the comparison handles it).
"""
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
