"""The two sublayers of a block: causal self-attention (written out, so its s x s scores are the
activation term notebook 00 measures) and the GELU MLP Y = GELU(XA)B."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from refimpl.model.config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q = nn.Linear(d, d)
        # No bias on K: softmax cancels it, its gradient is zero, and Adam would turn that zero's
        # round-off (different on 1 and N ranks) into full-size steps.
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(attention(self.q(x), self.k(x), self.v(x), self.n_heads))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Causal multi-head attention on [batch, seq, n_heads*head_dim] inputs."""
    b, s, width = q.shape
    hd = width // n_heads
    q, k, v = (t.view(b, s, n_heads, hd).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    return (probs @ v).transpose(1, 2).reshape(b, s, width)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def linear_weight_grads(x: torch.Tensor, dy: torch.Tensor, bias: bool) -> list[torch.Tensor]:
    """A linear's weight gradients from its input X and output gradient dY: dA = dYᵀ·X, and with a
    bias, db = dY summed over the tokens."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    weight = dy2.t() @ x.reshape(-1, x.shape[-1])
    return [weight, dy2.sum(0)] if bias else [weight]


class WatchedLinear(nn.Module):
    """A linear layer whose matmul is not its whole forward (tp's, with SP's collectives): it reports
    the matmul's X and Y and owns its weight-gradient formula (what zero bubble's deferred W needs)."""
    matmul_watcher = None

    def watch_matmul(self, watcher) -> None:
        """Call `watcher(module, x, y)` after each matmul (None: stop)."""
        self.matmul_watcher = watcher

    def _matmul(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        y = F.linear(x, self.weight, bias)
        if self.matmul_watcher is not None:
            self.matmul_watcher(self, x, y)
        return y

    def weight_grads(self, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
        return linear_weight_grads(x, dy, self.bias is not None)
