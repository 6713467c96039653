"""The SwiGLU feed-forward layer (Shazeer 2020, "GLU Variants Improve Transformer"): Llama's MLP,
and each of Mixtral's experts.

    Y = (SiLU(X W_gate) ⊙ X W_up) W_down

Three h x w matrices and no biases. Under tensor parallelism W_gate and W_up are split by columns
(each rank's slice of the w channels, the product ⊙ channel by channel needs no communication) and
W_down by rows, as the GELU MLP's A and B (Megatron's MLP split).
"""
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
