"""Ring attention over tensor-parallel heads (tp x cp): context parallelism on a tp model."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from refimpl.model.gqa import grouped_qkv
from refimpl.parallel.cp.ring import positions, ring_attention
from refimpl.parallel.tp.attention import ParallelGroupedAttention, ParallelSelfAttention
from refimpl.parallel.tp.mappings import enter_region
from refimpl.parallel.tp.vocab import VocabParallelEmbedding
from refimpl.seam import phase


class RingParallelSelfAttention(nn.Module):
    """ParallelSelfAttention's modules (names unchanged), ring attention over `cp_group` on this
    tp rank's heads in the middle."""

    def __init__(self, attn: ParallelSelfAttention, cp_group, balanced: bool = True):
        super().__init__()
        self.q, self.k, self.v, self.o = attn.q, attn.k, attn.v, attn.o
        self.n_heads, self.label = attn.n_heads, attn.label          # the local heads: a / tp
        self.group, self.sequence_parallel = attn.group, attn.sequence_parallel
        self.cp_group, self.balanced = cp_group, balanced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with phase(self.label):
            x = enter_region(x, self.group, self.sequence_parallel)
            out = ring_attention(self.q(x), self.k(x), self.v(x), self.n_heads, self.cp_group,
                                 balanced=self.balanced)
            return self.o(out)


class RingParallelGroupedAttention(nn.Module):
    """ParallelGroupedAttention's modules (names unchanged): this tp rank's query heads and the
    key/value heads they read, rotated by this cp rank's global positions, ringed over
    `cp_group` (refimpl.parallel.cp.parallelize.RingGroupedAttention, on a tp rank's heads)."""

    def __init__(self, attn, cp_group, rank: int, cp: int, balanced: bool = True):
        super().__init__()
        self.q, self.k, self.v, self.o = attn.q, attn.k, attn.v, attn.o
        self.n_heads, self.n_kv_heads, self.theta = attn.n_heads, attn.n_kv_heads, attn.theta
        self.label = attn.label
        self.group, self.sequence_parallel = attn.group, attn.sequence_parallel
        self.cp_group, self.rank, self.cp, self.balanced = cp_group, rank, cp, balanced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with phase(self.label):
            x = enter_region(x, self.group, self.sequence_parallel)
            where = _cp_positions(x.shape[1], x.device, rank=self.rank, cp=self.cp,
                                  balanced=self.balanced)
            q, k, v = grouped_qkv(self.q(x), self.k(x), self.v(x), self.n_heads,
                                  self.n_kv_heads, where, self.theta)
            return self.o(ring_attention(q, k, v, self.n_heads, self.cp_group,
                                         balanced=self.balanced))


def _cp_positions(length: int, device, *, rank: int, cp: int, balanced: bool) -> torch.Tensor:
    """The global positions of a cp rank's `length` tokens (its two chunks of a cp·length sequence)."""
    return positions(rank, cp, length * cp, balanced=balanced, device=device)


def apply_context_parallel_over_tp(model: nn.Module, cp_group, rank: int, cp: int, *,
                                   balanced: bool = True) -> nn.Module:
    """Context parallelism (in place) on a model `parallelize_tp` already transformed."""
    if cp == 1:
        return model
    if not isinstance(model.embed, VocabParallelEmbedding):
        raise TypeError("apply_context_parallel_over_tp expects a tensor-parallel model "
                        "(refimpl.parallel.tp.parallelize_tp first)")
    model.embed.position_ids = functools.partial(_cp_positions, rank=rank, cp=cp, balanced=balanced)
    for block in model.blocks:
        block.attn = (RingParallelGroupedAttention(block.attn, cp_group, rank, cp, balanced)
                      if isinstance(block.attn, ParallelGroupedAttention) else
                      RingParallelSelfAttention(block.attn, cp_group, balanced))
    return model


def tp_cp_layout_problem(seq_len: int, tp: int, cp: int, sequence_parallel: bool) -> str | None:
    """One line naming what a tp x cp layout breaks, or None."""
    if cp > 1 and sequence_parallel and (seq_len // cp) % tp:
        return (f"--sequence-parallel with --cp {cp} needs the s/cp = {seq_len // cp} tokens a cp "
                f"rank holds divisible by --tp {tp} (the tp ranks split them)")
    return None
