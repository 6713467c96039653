"""Vocabulary parallelism (Megatron-LM, Shoeybi et al. 2019, §3): rank r owns token ids
[r·V/t, (r+1)·V/t) of the embedding and the output layer, and the cross-entropy never gathers the
logits. Per token it all-reduces three numbers, not V logits:

    loss = log Σ_v exp(z_v - max) - (z_target - max)      max, z_target, Σ exp each summed over tp

A V that t does not divide is padded; padded logits are masked to -inf, so the loss is single's.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ReduceOp

from refimpl.parallel.tp.layers import shard_rows
from refimpl.parallel.tp.mappings import all_reduce, exit_region, group_rank, group_size
from refimpl.placement import Shard, set_placement


class VocabParallelEmbedding(nn.Module):
    """The token table split by id: each rank looks up the ids it owns, zeros for the others, and
    the rows are summed over tp (g, or SP's reduce-scatter). Positions stay replicated."""

    def __init__(self, tok_local: torch.Tensor, pos: torch.Tensor | None, vocab_size: int, group,
                 sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel, self.vocab_size = group, sequence_parallel, vocab_size
        self.tok = nn.Embedding(*tok_local.shape, _weight=tok_local)
        self.pos = nn.Embedding(*pos.shape, _weight=pos) if pos is not None else None   # Llama: none
        self.start = group_rank(group) * tok_local.shape[0]
        self.position_ids = None   # (length, device) -> positions held; None: 0 .. s-1 (tp x cp)
        set_placement(self.tok.weight, Shard("tp", 0, vocab_size))

    @classmethod
    def from_embedding(cls, embed: nn.Module, group=None,
                       sequence_parallel: bool = False) -> "VocabParallelEmbedding":
        tok = shard_rows(embed.tok.weight.detach(), group, pad=True)
        pos = embed.pos.weight.detach().clone() if embed.pos is not None else None
        return cls(tok, pos, embed.tok.num_embeddings, group, sequence_parallel)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start
        foreign = (local < 0) | (local >= self.tok.num_embeddings)
        rows = self.tok(local.masked_fill(foreign, 0)).masked_fill(foreign.unsqueeze(-1), 0.0)
        x = exit_region(rows, self.group, self.sequence_parallel)   # exactly one rank's row non-zero
        if self.pos is None:
            return x
        s = x.shape[1]
        where = (torch.arange(idx.shape[1], device=idx.device) if self.position_ids is None
                 else self.position_ids(idx.shape[1], idx.device))
        first = group_rank(self.group) * s if self.sequence_parallel else 0
        return x + self.pos(where[first:first + s])


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, start: int, vocab_size: int):
        n_local = logits.shape[-1]
        ids = torch.arange(start, start + n_local, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))      # padding columns
        shifted = logits - all_reduce(logits.max(dim=-1).values, group, ReduceOp.MAX).unsqueeze(-1)
        local_target = targets - start
        mine = (local_target >= 0) & (local_target < n_local)
        index = local_target.masked_fill(~mine, 0).unsqueeze(-1)
        target_logit = all_reduce(shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0), group)
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, mine)   # the softmax
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index, -mine.to(grad.dtype).unsqueeze(-1))   # - onehot(target)
        return grad * grad_loss.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, start: int,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token -log softmax(z)[target] from this rank's columns [start, start + V_local) of z."""
    if group_size(group) == 1 and logits.shape[-1] == vocab_size:
        return F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1),
                               reduction="none").view(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, group, start, vocab_size)
