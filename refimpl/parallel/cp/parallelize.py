"""The context-parallel transform: the reference GPT, run on this rank's slice of every sequence.

    model = apply_context_parallel(build_model(cfg, seed), group)   # group: the cp axis's
    local = shard_batch(batch, rank, cp)                             # its two chunks of each row"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.model import GPT, Batch
from refimpl.model.gqa import GroupedQueryAttention, grouped_qkv
from refimpl.parallel.cp.ring import positions, ring_attention, shard_sequence


class RingSelfAttention(nn.Module):
    """CausalSelfAttention's projections, with ring attention over `group` in the middle."""

    def __init__(self, attn: nn.Module, group, balanced: bool = True):
        super().__init__()
        self.q, self.k, self.v, self.o = attn.q, attn.k, attn.v, attn.o
        self.n_heads, self.group, self.balanced = attn.n_heads, group, balanced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ring_attention(self.q(x), self.k(x), self.v(x), self.n_heads, self.group,
                             balanced=self.balanced)
        return self.o(out)


class RingGroupedAttention(nn.Module):
    """Llama's grouped-query attention (refimpl.model.gqa) with ring attention in the middle: Q
    and K rotated by this rank's tokens' global positions (its two chunks of each sequence),
    then K and V widened to one head per query head before the ring. The ring therefore carries
    n_heads / n_kv_heads times the K/V bytes a ring of the key/value heads alone would (that
    ring, and its bytes in refimpl.lab.predict.cp_comm, are not built here)."""

    def __init__(self, attn: nn.Module, group, rank: int, cp: int, balanced: bool = True):
        super().__init__()
        self.q, self.k, self.v, self.o = attn.q, attn.k, attn.v, attn.o
        self.n_heads, self.n_kv_heads, self.theta = attn.n_heads, attn.n_kv_heads, attn.theta
        self.group, self.rank, self.cp, self.balanced = group, rank, cp, balanced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        where = positions(self.rank, self.cp, x.shape[1] * self.cp, balanced=self.balanced,
                          device=x.device)
        q, k, v = grouped_qkv(self.q(x), self.k(x), self.v(x), self.n_heads, self.n_kv_heads,
                              where, self.theta)
        return self.o(ring_attention(q, k, v, self.n_heads, self.group, balanced=self.balanced))


class SlicedEmbedding(nn.Module):
    """Token + position embedding for a slice of the sequence: positions of this rank's chunks."""

    def __init__(self, embed: nn.Module, rank: int, cp: int, balanced: bool = True):
        super().__init__()
        self.tok, self.pos = embed.tok, embed.pos
        self.rank, self.cp, self.balanced = rank, cp, balanced

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.pos is None:        # Llama: positions are rotations, inside attention
            return self.tok(idx)
        full_len = idx.shape[1] * self.cp
        where = positions(self.rank, self.cp, full_len, balanced=self.balanced, device=idx.device)
        return self.tok(idx) + self.pos(where)


def _rank_and_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def apply_context_parallel(model: GPT, group, *, balanced: bool = True) -> GPT:
    """Turn `model` (in place) into its context-parallel form over `group` (None: cp = 1)."""
    rank, cp = _rank_and_size(group)
    if cp == 1:
        return model
    model.embed = SlicedEmbedding(model.embed, rank, cp, balanced)
    for block in model.blocks:
        block.attn = (RingGroupedAttention(block.attn, group, rank, cp, balanced)
                      if isinstance(block.attn, GroupedQueryAttention) else
                      RingSelfAttention(block.attn, group, balanced))
    return model


def shard_batch(batch: Batch, rank: int, cp: int, *, balanced: bool = True) -> Batch:
    """This cp rank's tokens of every sequence (inputs and targets cut the same way)."""
    if cp == 1:
        return batch
    return Batch(shard_sequence(batch.inputs, rank, cp, balanced=balanced),
                 shard_sequence(batch.targets, rank, cp, balanced=balanced))
