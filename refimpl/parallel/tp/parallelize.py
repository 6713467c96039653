"""`parallelize_tp`: the reference GPT turned, in place, into this rank's tensor-parallel model
(names kept); norms stay replicated.

    parallelize_tp(model, group, sequence_parallel=sp)
    loss = tp_loss_for(model.lm_head)(model(inputs), targets)   # vocabulary-parallel cross-entropy"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from refimpl.model.moe import MoEMLP
from refimpl.parallel.tp.attention import parallel_attention
from refimpl.parallel.tp.blocks import parallel_feed_forward
from refimpl.parallel.tp.experts import parallelize_moe
from refimpl.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear
from refimpl.parallel.tp.mappings import all_reduce, group_size
from refimpl.parallel.tp.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


def parallelize_tp(model: nn.Module, group, sequence_parallel: bool = False) -> nn.Module:
    """Replace the reference GPT's layers by this rank's tensor-parallel ones (in place)."""
    sp = sequence_parallel and group_size(group) > 1
    model.embed = VocabParallelEmbedding.from_embedding(model.embed, group, sp)
    for block in model.blocks:
        block.attn = parallel_attention(block.attn, group, sp)
        if isinstance(block.mlp, MoEMLP):    # every expert split over tp
            parallelize_moe(block.mlp, group, sp)
        else:
            block.mlp = parallel_feed_forward(block.mlp, group, sp)
    # the output layer reads the final norm's output: full tokens (f) or gathered ones (SP)
    model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group, sequence_parallel=sp,
                                                     pad=True)
    if model.cfg.tie_embeddings:   # same vocabulary split and padding: one shard for both
        model.lm_head.weight = model.embed.tok.weight
    for p in sequence_partial(model, sp):
        p.register_hook(functools.partial(all_reduce, group=group))
    return model


def sequence_partial(model: nn.Module, sequence_parallel: bool) -> list[nn.Parameter]:
    """The replicated parameters of a `parallelize_tp`'d model whose gradient, under SP, covers
    this rank's tokens only: the norms, the row-parallel biases, the position table."""
    if not sequence_parallel:
        return []
    norms = [model.final_norm] + [n for block in model.blocks for n in (block.ln1, block.ln2)]
    # a row layer's bias is added after SP's reduce-scatter (an expert's, built without SP, is not)
    biases = [m.bias for m in model.modules()
              if isinstance(m, RowParallelLinear) and m.sequence_parallel and m.bias is not None]
    positions = [] if model.embed.pos is None else [model.embed.pos.weight]
    return [p for n in norms for p in n.parameters()] + positions + biases


def tp_loss_for(head: ColumnParallelLinear):
    """The vocabulary-parallel loss of (logits, targets), holding only the head's group and
    vocabulary slice, not the model (a pipeline's loss must not keep every stage alive)."""
    return functools.partial(_vocab_loss, head.group, head.out_start, head.out_full)


def _vocab_loss(group, out_start: int, vocab: int, logits, targets) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, targets, group, out_start, vocab).mean()
