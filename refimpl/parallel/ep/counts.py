"""The MoE layer's routing counts, gathered over the ranks that hold the other tokens.

The layer (refimpl.model.moe) decides capacity and the aux loss's f_i from how many assignments
each expert got; in one process it counts its own batch. Wherever a layout spreads the tokens of
one forward over several ranks, those counts must be the whole forward's, or a rank would drop
other tokens than the single process drops. This file holds those collectives (the model holds
none: it asks its `dispatch` and its `sequences` for the counts):

    all_gather_counts   [ranks, E] counts of every rank of a group, in batch order (one all-gather
                        of E integers per MoE layer and forward)
    SharedCounts        data parallelism without expert parallelism: every replica keeps every
                        expert, and gathers the counts over dp x cp (capacity_scope=batch)
    ChunkedSequences    context parallelism under capacity_scope=sequence: a cp rank holds pieces
                        of every sequence, and gathers their counts over cp (refimpl.model.
                        moe_sequence says why a sequence's counts make every layout equal single)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.labels import comm_span
from refimpl.model.moe import LocalExperts


def all_gather_counts(counts: torch.Tensor, group, comm) -> tuple[torch.Tensor, int]:
    """[ranks, E] per-expert counts of every rank of `group` (in batch order), and my row."""
    n = dist.get_world_size(group)
    rows = [torch.empty_like(counts) for _ in range(n)]
    with comm_span("all_gather", counts.nbytes * n):
        comm.all_gather(rows, counts, group=group)
    return torch.stack(rows), dist.get_rank(group)


class SharedCounts(LocalExperts):
    """Every expert in this process, the counts over `token_group` (the ranks holding the other
    rows of the batch): a data-parallel replica's dispatch."""

    def __init__(self, token_group, comm=dist):
        super().__init__()
        self.token_group, self.comm = token_group, comm

    def gather_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        return all_gather_counts(counts, self.token_group, self.comm)


class ChunkedSequences:
    """Context parallelism: of the `pieces` equal pieces of each sequence, cp rank j holds
    `chunks[j]` (its local tokens are those pieces, concatenated in that order). The layer's
    `sequences` (refimpl.model.moe_sequence.WholeSequences without cp)."""

    def __init__(self, chunks: list[tuple[int, ...]], group, comm=dist):
        self.chunks, self.group, self.comm = [tuple(c) for c in chunks], group, comm
        self.held = self.chunks[dist.get_rank(group)]
        self.pieces = sum(len(c) for c in self.chunks)

    def gather(self, counts: torch.Tensor) -> torch.Tensor:
        """[rows, held, E] counts of this rank -> [rows, pieces, E], every piece in sequence order."""
        parts = [torch.empty_like(counts) for _ in self.chunks]
        with comm_span("all_gather", counts.nbytes * len(parts)):
            self.comm.all_gather(parts, counts, group=self.group)
        # piece p is column i of rank r's part: stacked by Python ints (an index list would be a
        # host-to-device copy, a stream sync, in every step)
        where = {p: (r, i) for r, ids in enumerate(self.chunks) for i, p in enumerate(ids)}
        return torch.stack([parts[r][:, i] for r, i in (where[p] for p in range(self.pieces))], dim=1)
