"""The SwiGLU feed-forward layer (Shazeer 2020, "GLU Variants Improve Transformer"): Llama's MLP,
and each of Mixtral's experts.

    Y = (SiLU(X W_gate) ⊙ X W_up) W_down"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
