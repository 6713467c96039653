"""Grouped-query attention (Ainslie et al. 2023, "GQA"): Llama's attention, with rotary positions:
each key/value head serves a group of n_heads / n_kv_heads consecutive query heads."""
from __future__ import annotations

import torch
import torch.nn as nn

from refimpl.model.config import GPTConfig
from refimpl.model.layers import attention
from refimpl.model.rotary import rotary_tables, rotate


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.theta = cfg.rope_theta
        self.q = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.v = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.o = nn.Linear(self.n_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        return self.o(grouped_attention(self.q(x), self.k(x), self.v(x), self.n_heads,
                                        self.n_kv_heads, positions, self.theta))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int,
                      n_kv_heads: int, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Causal attention of [batch, seq, heads·head_dim] queries on kv_heads keys and values, the
    tokens at `positions`; the head counts are those in these tensors (a tp rank's share)."""
    return attention(*grouped_qkv(q, k, v, n_heads, n_kv_heads, positions, theta), n_heads)


def grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_kv_heads: int,
                positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, ...]:
    """Q and K rotated by their positions, K and V repeated to one head per query head: multi-head
    attention's inputs, [batch, seq, n_heads·head_dim] each (for `attention` or cp's ring)."""
    b, s, width = q.shape
    hd = width // n_heads
    q = q.view(b, s, n_heads, hd).transpose(1, 2)
    k, v = (t.view(b, s, n_kv_heads, hd).transpose(1, 2) for t in (k, v))
    cos, sin = rotary_tables(positions, hd, theta, q.dtype)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    group = n_heads // n_kv_heads
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return tuple(t.transpose(1, 2).reshape(b, s, width) for t in (q, k, v))
