"""Ring attention over tensor-parallel heads (tp x cp): context parallelism on a tp model."""
from __future__ import annotations

import torch.nn as nn

from refimpl.parallel.cp.parallelize import RingGroupedAttention, RingSelfAttention
from refimpl.parallel.cp.ring import RingPlace
from refimpl.parallel.tp.attention import ParallelGroupedAttention, ParallelSelfAttention
from refimpl.parallel.tp.vocab import VocabParallelEmbedding


class RingParallelSelfAttention(ParallelSelfAttention):
    """ParallelSelfAttention (names unchanged) with cp's `attend`: this tp rank's heads, ringed
    among its cp peers."""
    attend = RingSelfAttention.attend

    def __init__(self, attn: ParallelSelfAttention, ring: RingPlace):
        super().__init__(attn.q, attn.k, attn.v, attn.o, attn.n_heads, attn.group,
                         attn.sequence_parallel)
        self.ring = ring


class RingParallelGroupedAttention(ParallelGroupedAttention):
    """ParallelGroupedAttention (names unchanged) with cp's `attend`: Q and K rotated by this cp
    rank's global positions, then ringed."""
    attend = RingGroupedAttention.attend

    def __init__(self, attn: ParallelGroupedAttention, ring: RingPlace):
        super().__init__(attn.q, attn.k, attn.v, attn.o, attn.n_heads, attn.n_kv_heads, attn.theta,
                         attn.group, attn.sequence_parallel)
        self.ring = ring


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

