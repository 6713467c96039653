"""Vocabulary parallelism: the embedding table and the output layer split by token id, and a
cross-entropy that never gathers the logits (Megatron-LM, Shoeybi et al. 2019, §3, last paragraphs).

The vocabulary is the widest matrix of a small model (V x h) and the logits its largest activation
(b·s·V). Rank r owns token ids [r·V/t, (r+1)·V/t):

  embedding      looks up the ids it owns, writes zeros for the others, and the ranks' rows are
                 summed (all-reduce; under sequence parallelism a reduce-scatter that also splits
                 the tokens). Exactly one rank contributes each row, so the sum is exact.
  output layer   column-parallel: rank r computes logits for its V/t ids only.
  cross-entropy  needs, per token, log Σ_v exp(z_v) - z_target over all V. Each rank reduces its own
                 columns to three numbers per token and the ranks all-reduce them: the max (for a
                 stable exp), the target's logit (only its owner has it; the others add 0) and
                 Σ exp(z - max). b·s floats each instead of b·s·V logits; backward is local:
                 softmax - onehot restricted to this rank's columns.

A vocabulary t does not divide is padded to the next multiple (510 on 4 ranks: 512, the last rank
holds 126 real ids and 2 padding rows). Padding rows are zero, never looked up, and their logits
are masked to -inf before the max and the sum, so they add exp(-inf) = 0 and get zero gradient:
the loss is single's, not a 512-way softmax's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from refimpl.parallel.tp.layers import _rows, exit_region
from refimpl.parallel.tp.mappings import all_reduce_logged, group_rank, group_size, mark_sequence_partial
from refimpl.placement import Shard, set_placement


class VocabParallelEmbedding(nn.Module):
    """The reference `Embedding` (tok + pos) with the token table split by vocabulary.

    Keeps the reference names `tok.weight` and `pos.weight`. The position table is small and
    replicated; under sequence parallelism each rank adds the positions of its own s/t tokens
    (so the table's gradient is partial over the sequence and is summed over tp, see tp.parallelize).
    """

    def __init__(self, tok_local: torch.Tensor, pos: torch.Tensor | None, vocab_size: int, group,
                 sequence_parallel: bool, comm=None):
        super().__init__()
        self.group, self.sequence_parallel, self.comm = group, sequence_parallel, comm or dist
        self.vocab_size = vocab_size
        self.tok = nn.Embedding(*tok_local.shape, _weight=tok_local)
        # Llama's model has no position table (rotary positions, inside attention)
        self.pos = nn.Embedding(*pos.shape, _weight=pos) if pos is not None else None
        self.start = group_rank(group) * tok_local.shape[0]
        # Positions of the tokens `idx` holds, as a function (length, device) -> ids: None is
        # 0 .. s-1; context parallelism (refimpl.compose.tp_cp) sets this rank's global ones.
        self.position_ids = None
        set_placement(self.tok.weight, Shard("tp", 0, vocab_size))
        if sequence_parallel and self.pos is not None:
            mark_sequence_partial(self.pos.weight)

    @classmethod
    def from_embedding(cls, embed: nn.Module, group=None, sequence_parallel: bool = False,
                       comm=None) -> "VocabParallelEmbedding":
        tok = _rows(embed.tok.weight.detach(), group, pad_to_multiple=True)
        pos = embed.pos.weight.detach().clone() if embed.pos is not None else None
        return cls(tok, pos, embed.tok.num_embeddings, group, sequence_parallel, comm)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start
        foreign = (local < 0) | (local >= self.tok.num_embeddings)
        rows = self.tok(local.masked_fill(foreign, 0)).masked_fill(foreign.unsqueeze(-1), 0.0)
        # the sum of one-hot contributions: exactly one rank's row is non-zero
        x = exit_region(rows, self.group, self.sequence_parallel, self.comm)
        if self.pos is None:
            return x
        s_local = x.shape[1]
        where = (torch.arange(idx.shape[1], device=idx.device) if self.position_ids is None
                 else self.position_ids(idx.shape[1], idx.device))
        first = group_rank(self.group) * s_local if self.sequence_parallel else 0
        return x + self.pos(where[first:first + s_local])


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, start: int, vocab_size: int, comm):
        n_local = logits.shape[-1]
        ids = torch.arange(start, start + n_local, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))      # padding columns
        row_max = all_reduce_logged(logits.max(dim=-1).values, group, op=dist.ReduceOp.MAX,
                                    comm=comm)
        shifted = logits - row_max.unsqueeze(-1)
        local_target = targets - start
        mine = (local_target >= 0) & (local_target < n_local)
        index = local_target.masked_fill(~mine, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0)
        target_logit = all_reduce_logged(target_logit, group, comm=comm)
        exp = shifted.exp()
        sum_exp = all_reduce_logged(exp.sum(dim=-1), group, comm=comm)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index, -mine.to(grad.dtype).unsqueeze(-1))   # - onehot(target)
        return grad * grad_loss.unsqueeze(-1), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, start: int,
                                 vocab_size: int, comm=dist) -> torch.Tensor:
    """Per-token -log softmax(z)[target] from this rank's columns [start, start + V_local) of z."""
    if group_size(group) == 1 and logits.shape[-1] == vocab_size:
        return F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1),
                               reduction="none").view(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, group, start, vocab_size, comm)
