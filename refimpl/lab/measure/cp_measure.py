"""Ring attention measured on real cp ranks (notebook 09 §3): the score blocks each rank computed,
measured as the matmul FLOPs of its forward, and the bytes autograd saved for backward on each
rank, beside full causal attention on one process (refimpl.model.attention) with the whole sequence.

What a rank saves: its own slice of q, k, v and of the output (s/cp tokens each) plus the
log-sum-exp per query; it never holds the s x s scores (a block's scores live only while the block
is computed, FlashAttention-style), nor more than two K/V blocks at a time (its own, and the one
arriving). Full attention saves the softmax probabilities, b·a·s² values.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from refimpl.lab.instrument.activations import ActivationTracker
from refimpl.launch import device_for
from refimpl.model import attention
from refimpl.parallel.cp.ring import blocks_to_compute, chunk_ids, ring_attention, shard_sequence


def unshard_sequence(parts, *, balanced: bool = True, dim: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence: every rank's part (rank order) back into the full sequence."""
    cp = len(parts)
    chunks = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        for i, piece in zip(chunk_ids(rank, cp, balanced), part.chunk(2, dim=dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)


def score_blocks_per_rank(cp: int, balanced: bool = True) -> list[int]:
    """Score blocks (chunk x chunk matmuls) each rank computes in one forward: the ring's work."""
    return [sum(len(blocks_to_compute(chunk_ids(r, cp, balanced), chunk_ids(src, cp, balanced)))
                for src in range(cp)) for r in range(cp)]


def counted_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, group,
                           *, balanced: bool = True) -> tuple[torch.Tensor, int]:
    """ring_attention's output and the score blocks this rank computed in its forward, measured:
    the forward's matmul FLOPs over one block's, Q·Kᵀ and P·V on chunk x chunk, 2 · 2·b·h·c²·d."""
    with FlopCounterMode(display=False) as counter:
        out = ring_attention(q, k, v, n_heads, group, balanced=balanced)
    b, s, width = q.shape
    c, d = s // 2, width // n_heads                 # this rank's two chunks, the head width
    per_block = 2 * 2 * b * n_heads * c * c * d
    blocks, rest = divmod(counter.get_total_flops(), per_block)
    if rest:
        raise AssertionError(f"{counter.get_total_flops()} FLOPs is not a whole number of score blocks")
    return out, blocks


def _inputs(batch: int, seq: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, width, generator=g) for _ in range(3)]


def ring_rank(rank: int, world: int, *, batch: int = 1, seq: int = 64, heads: int = 4, head_dim: int = 16,
              seed: int = 0) -> list[dict]:
    """On one rank of a cp ring of the whole world, both layouts in turn: score blocks this rank
    computed and the peak bytes autograd saved across forward + backward."""
    group = dist.new_group(list(range(world)))
    device = device_for(dist.get_backend())
    out = []
    for balanced in (True, False):
        q, k, v = (shard_sequence(t, rank, world, balanced=balanced).to(device).requires_grad_()
                   for t in _inputs(batch, seq, heads * head_dim, seed))
        with ActivationTracker() as saved:
            attended, blocks = counted_ring_attention(q, k, v, heads, group, balanced=balanced)
            attended.sum().backward()
        out.append({"rank": rank, "layout": "head-tail" if balanced else "contiguous",
                    "score_blocks": blocks, "saved_bytes": saved.peak})
    return out


def full_attention_saved_bytes(*, batch: int = 1, seq: int = 64, heads: int = 4, head_dim: int = 16,
                               seed: int = 0) -> int:
    """Peak bytes autograd saves for full causal attention over the whole sequence, one process."""
    q, k, v = (t.requires_grad_() for t in _inputs(batch, seq, heads * head_dim, seed))
    with ActivationTracker() as saved:
        attention(q, k, v, heads).sum().backward()
    return saved.peak


def work_table(cp: int):
    """score_blocks_per_rank for both layouts as a DataFrame (rank, layout, score_blocks)."""
    import pandas as pd

    return pd.DataFrame([{"rank": r, "layout": name, "score_blocks": n}
                         for name, balanced in (("head-tail", True), ("contiguous", False))
                         for r, n in enumerate(score_blocks_per_rank(cp, balanced))])
