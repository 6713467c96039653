"""Ring attention over tensor-parallel heads (tp x cp): context parallelism on a tp model."""
from __future__ import annotations

import torch
import torch.nn as nn

from refimpl.model.gqa import grouped_qkv
from refimpl.parallel.cp.ring import RingPlace, ring_attention
from refimpl.parallel.tp.attention import ParallelGroupedAttention, ParallelSelfAttention
from refimpl.parallel.tp.vocab import VocabParallelEmbedding


class RingParallelSelfAttention(ParallelSelfAttention):
    """ParallelSelfAttention (names unchanged), ringing this tp rank's heads among its cp peers."""

    def __init__(self, attn: ParallelSelfAttention, ring: RingPlace):
        super().__init__(attn.q, attn.k, attn.v, attn.o, attn.n_heads, attn.group,
                         attn.sequence_parallel)
        self.ring = ring

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.n_heads, self.ring.group, balanced=self.ring.balanced)


class RingParallelGroupedAttention(ParallelGroupedAttention):
    """ParallelGroupedAttention (names unchanged): Q and K rotated by this cp rank's global
    positions, then ringed as refimpl.parallel.cp.parallelize.RingGroupedAttention does."""

    def __init__(self, attn: ParallelGroupedAttention, ring: RingPlace):
        super().__init__(attn.q, attn.k, attn.v, attn.o, attn.n_heads, attn.n_kv_heads, attn.theta,
                         attn.group, attn.sequence_parallel)
        self.ring = ring

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = grouped_qkv(q, k, v, self.n_heads, self.n_kv_heads,
                              self.ring.positions(q.shape[1], q.device), self.theta)
        return ring_attention(q, k, v, self.n_heads, self.ring.group, balanced=self.ring.balanced)


def apply_context_parallel_over_tp(model: nn.Module, cp_group, rank: int, cp: int, *,
                                   balanced: bool = True) -> nn.Module:
    """Context parallelism (in place) on a model `parallelize_tp` already transformed."""
    if cp == 1:
        return model
    if not isinstance(model.embed, VocabParallelEmbedding):
        raise TypeError("apply_context_parallel_over_tp expects a tensor-parallel model "
                        "(refimpl.parallel.tp.parallelize_tp first)")
    ring = RingPlace(cp_group, rank, cp, balanced)
    model.embed.position_ids = ring.positions
    for block in model.blocks:
        kind = (RingParallelGroupedAttention if isinstance(block.attn, ParallelGroupedAttention)
                else RingParallelSelfAttention)
        block.attn = kind(block.attn, ring)
    return model

