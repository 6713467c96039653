"""The MoE layer's routing counts, gathered over the ranks that hold the other tokens."""
from __future__ import annotations

import torch

from refimpl.model.moe import LocalExperts
from refimpl.seam import dist


class SharedCounts(LocalExperts):
    """A dispatch counting over `token_group` (the ranks holding the other rows of the batch): with
    every expert in this process, a data-parallel replica's (ExpertParallelDispatch spreads them)."""

    def __init__(self, token_group):
        self.token_group = token_group

    def gather_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        """[ranks, E] per-expert counts of every rank of `token_group` (in batch order), my row."""
        rows = [torch.empty_like(counts) for _ in range(dist.get_world_size(self.token_group))]
        dist.all_gather(rows, counts, group=self.token_group)
        return torch.stack(rows), dist.get_rank(self.token_group)


class ChunkedSequences:
    """An MoE layer's `sequences` under cp: rank j holds pieces `chunks[j]` of each sequence, in
    that order (refimpl.model.moe_sequence.WholeSequences without cp)."""

    def __init__(self, chunks: list[tuple[int, ...]], group):
        self.chunks, self.group = [tuple(c) for c in chunks], group
        self.held = self.chunks[dist.get_rank(group)]
        self.pieces = sum(len(c) for c in self.chunks)

    def gather(self, counts: torch.Tensor) -> torch.Tensor:
        """[rows, held, E] counts of this rank -> [rows, pieces, E], every piece in sequence order."""
        parts = [torch.empty_like(counts) for _ in self.chunks]
        dist.all_gather(parts, counts, group=self.group)
        # piece p is column i of rank r's part (Python ints: an index tensor would sync the stream)
        where = {p: (r, i) for r, ids in enumerate(self.chunks) for i, p in enumerate(ids)}
        return torch.stack([parts[r][:, i] for r, i in (where[p] for p in range(self.pieces))], dim=1)
