"""The parts of a block by architecture (GPTConfig.arch): one place that says which norm,
attention and feed-forward layer a "gpt" or a "llama" block is made of."""
from __future__ import annotations

import torch.nn as nn

from refimpl.model.config import GPTConfig
from refimpl.model.gqa import GroupedQueryAttention
from refimpl.model.layers import MLP, CausalSelfAttention
from refimpl.model.rmsnorm import RMSNorm
from refimpl.model.swiglu import SwiGLU


def norm(cfg: GPTConfig) -> nn.Module:
    return RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.arch == "llama" else nn.LayerNorm(cfg.d_model)


def self_attention(cfg: GPTConfig) -> nn.Module:
    return GroupedQueryAttention(cfg) if cfg.arch == "llama" else CausalSelfAttention(cfg)


def feed_forward(cfg: GPTConfig) -> nn.Module:
    """The dense MLP, and the shape of each expert of a mixture."""
    return SwiGLU(cfg.d_model, cfg.swiglu_hidden) if cfg.arch == "llama" else MLP(cfg)

