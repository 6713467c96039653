"""The reference model: a tiny GPT, deterministic from a seed."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from refimpl.model.config import GPTConfig
from refimpl.model.init import init_parameters, values_not_drawn
from refimpl.model.moe import MoEMLP, recompute_contexts
from refimpl.model.parts import feed_forward, norm, self_attention


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = self_attention(cfg)
        self.ln2 = norm(cfg)
        self.mlp = MoEMLP(cfg) if cfg.n_experts > 0 else feed_forward(cfg)   # dense, or experts
        self.recompute = False    # activation checkpointing: keep the input, recompute in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            # use_reentrant=False: works with autograd hooks and saved-tensor hooks
            return checkpoint(self._forward, x, use_reentrant=False, context_fn=recompute_contexts)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Llama has no position table: its positions are rotations inside attention
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.arch == "gpt" else None
        self.position_ids = None   # (length, device) -> positions held; None: 0 .. s-1 (cp's ring)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.pos is None:
            return self.tok(idx)
        positions = (torch.arange(idx.shape[1], device=idx.device) if self.position_ids is None
                     else self.position_ids(idx.shape[1], idx.device))
        return self.tok(idx) + self.pos(positions)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


def build_model(cfg: GPTConfig, seed: int, device="cpu") -> GPT:
    """The reference weights: every rank that calls this with the same seed gets the same model."""
    with torch.device(device), values_not_drawn():
        model = GPT(cfg)
    return model if torch.device(device).type == "meta" else init_parameters(model, seed)


def converted(module: nn.Module, *, device=None, dtype=None) -> nn.Module:
    """`module.to(device, dtype)` where a tensor of it differs, else `module` untouched."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all((device is None or t.device == torch.device(device))
           and (dtype is None or not t.is_floating_point() or t.dtype == dtype) for t in tensors):
        return module
    return module.to(device=device, dtype=dtype)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the batch given."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() skips tied duplicates
