"""The context-parallel transform: the reference GPT, run on this rank's slice of every sequence.

    model = apply_context_parallel(build_model(cfg, seed), group)   # group: the cp axis's
    local = shard_batch(batch, rank, cp)                             # its two chunks of each row"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.model import GPT, Batch
from refimpl.model.gqa import GroupedQueryAttention, grouped_qkv
from refimpl.parallel.cp.ring import RingPlace, ring_attention, shard_sequence


class RingSelfAttention(nn.Module):
    """CausalSelfAttention's projections, with ring attention over the cp group in the middle."""

    def __init__(self, attn: nn.Module, ring: RingPlace):
        super().__init__()
        self.q, self.k, self.v, self.o = attn.q, attn.k, attn.v, attn.o
        self.n_heads, self.ring = attn.n_heads, ring

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.n_heads, self.ring.group, balanced=self.ring.balanced)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.attend(self.q(x), self.k(x), self.v(x)))


class RingGroupedAttention(RingSelfAttention):
    """Llama's grouped-query attention on the ring: Q and K rotated by this rank's global
    positions, K and V widened to one head per query head before the ring (n_heads / n_kv_heads
    times the bytes a ring of the K/V heads alone would carry)."""

    def __init__(self, attn: nn.Module, ring: RingPlace):
        super().__init__(attn, ring)
        self.n_kv_heads, self.theta = attn.n_kv_heads, attn.theta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = grouped_qkv(q, k, v, self.n_heads, self.n_kv_heads,
                              self.ring.positions(q.shape[1], q.device), self.theta)
        return ring_attention(q, k, v, self.n_heads, self.ring.group, balanced=self.ring.balanced)


def apply_context_parallel(model: GPT, group, *, balanced: bool = True) -> GPT:
    """Turn `model` (in place) into its context-parallel form over `group` (None: cp = 1)."""
    if group is None or dist.get_world_size(group) == 1:
        return model
    ring = RingPlace(group, dist.get_rank(group), dist.get_world_size(group), balanced)
    model.embed.position_ids = ring.positions    # the global positions of this rank's tokens
    for block in model.blocks:
        kind = RingGroupedAttention if isinstance(block.attn, GroupedQueryAttention) else RingSelfAttention
        block.attn = kind(block.attn, ring)
    return model


def shard_batch(batch: Batch, rank: int, cp: int, *, balanced: bool = True) -> Batch:
    """This cp rank's tokens of every sequence (inputs and targets cut the same way)."""
    if cp == 1:
        return batch
    return Batch(shard_sequence(batch.inputs, rank, cp, balanced=balanced),
                 shard_sequence(batch.targets, rank, cp, balanced=balanced))
