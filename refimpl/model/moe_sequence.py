"""Capacity and the aux loss per sequence (`--set capacity_scope=sequence`): no layout changes it."""
from __future__ import annotations

import torch

from refimpl.model.moe_slots import one_hot


class WholeSequences:
    """This rank holds its sequences whole, one piece each (under cp: ep.counts.ChunkedSequences)."""

    held: tuple[int, ...] = (0,)
    pieces = 1

    def gather(self, counts: torch.Tensor) -> torch.Tensor:
        return counts


def sequence_tokens(local_tokens: int, rows: int, layout) -> int:
    """S: tokens of one whole sequence, from this rank's share of it."""
    return local_tokens // rows // len(layout.held) * layout.pieces


def keep_per_sequence(experts_flat: torch.Tensor, rows: int, n_experts: int, capacity: int,
                      layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Which assignments fit under C per sequence, and each sequence's whole counts [rows, E]."""
    a = experts_flat.view(rows, len(layout.held), -1)      # [sequence, piece, assignment]
    hot = one_hot(a.reshape(-1), n_experts).view(a.shape + (n_experts,))   # [rows, held, n, E]
    full = layout.gather(hot.sum(dim=2))                # [rows, pieces, E]
    earlier = full.cumsum(dim=1) - full                     # queued by the pieces before each one
    mine = torch.stack([earlier[:, p] for p in layout.held], dim=1)   # Python ints: no copy
    place = hot.cumsum(dim=2) - 1 + mine.unsqueeze(2)
    keep = place.gather(3, a.unsqueeze(3)).squeeze(3) < capacity
    return keep.reshape(-1), full.sum(dim=1)


def sequence_aux_loss(probs: torch.Tensor, per_sequence: torch.Tensor, top_k: int, seq_tokens: int,
                      alpha: float) -> torch.Tensor:
    """Mean over this rank's sequences of alpha * E * sum_i f_i P_i: f_i from the whole sequence's
    counts ([rows, E]), P_i from this rank's tokens of it."""
    rows, n_experts = per_sequence.shape
    f = per_sequence.to(probs.dtype) / (top_k * seq_tokens)
    p = probs.view(rows, -1, n_experts).mean(dim=1)
    return alpha * n_experts * (f * p).sum(dim=1).mean()
