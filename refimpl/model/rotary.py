"""Rotary position embeddings (Su et al. 2021, "RoFormer", §3.4): Llama's positions."""
from __future__ import annotations

import torch


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, channel) angle: [len(positions), head_dim] each."""
    channels = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inverse_frequency = 1.0 / (theta ** (channels / head_dim))
    angles = positions.to(torch.float32)[:, None] * inverse_frequency[None, :]
    angles = torch.cat((angles, angles), dim=-1)     # channel i and i + d/2 share an angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]. Rotates each pair (x_i, x_{i+d/2}) by its angle:
    (x_i cos - x_{i+d/2} sin, x_{i+d/2} cos + x_i sin)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
