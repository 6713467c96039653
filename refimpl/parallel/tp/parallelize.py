"""`parallelize_tp`: the reference GPT turned, in place, into this rank's tensor-parallel model
(names kept): attention and MLP split by tp/attention.py and tp/blocks.py (experts by
tp/experts.py), the vocabulary by tp/vocab.py; norms stay replicated.

    parallelize_tp(model, group, sequence_parallel=sp)
    loss = tp_lm_loss(model, model(inputs), targets)    # vocabulary-parallel cross-entropy
    full = gather_tp_state_dict(model, group)           # == single's state dict"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from refimpl.model.moe import MoEMLP
from refimpl.parallel.tp.attention import kv_split, parallel_attention
from refimpl.parallel.tp.blocks import parallel_feed_forward
from refimpl.parallel.tp.experts import parallelize_moe
from refimpl.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear
from refimpl.parallel.tp.mappings import all_reduce, group_size
from refimpl.parallel.tp.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy
from refimpl.placement import GroupMesh, gather_full_state_dict


def tp_layout_problem(cfg, tp: int, seq_len: int | None = None,
                      sequence_parallel: bool = False) -> str | None:
    """One line naming the constraint a model config breaks for this tp, or None if it fits."""
    if cfg.n_heads % tp:
        return f"--tp {tp} must divide the number of attention heads ({cfg.n_heads})"
    width = cfg.swiglu_hidden if cfg.arch == "llama" else cfg.mlp_ratio * cfg.d_model
    if width % tp:   # implied by the heads for a 4h MLP; not for SwiGLU's ffn_hidden
        return f"--tp {tp} must divide the MLP width ({width})"
    if cfg.arch == "llama":
        try:
            kv_split(cfg.kv_heads, tp)
        except ValueError as e:
            return str(e)
    if sequence_parallel and seq_len is not None and seq_len % tp:
        return f"--sequence-parallel needs --seq-len ({seq_len}) divisible by --tp {tp}"
    return None


def tp_overlap_problem(cfg) -> str | None:
    """One line naming why `--set tp_overlap=true` cannot run a TrainConfig, or None: the ring
    replaces SP's collectives, zero bubble's W needs the gathered input the ring never builds
    (ParallelLinear.watch_matmul), and the ring's Functions run in the input's dtype."""
    if not cfg.options.get("tp_overlap", False):
        return None
    if not cfg.sequence_parallel:
        return "--set tp_overlap=true needs --sequence-parallel (it decomposes SP's all-gather and reduce-scatter)"
    if cfg.pp > 1:
        return "--set tp_overlap=true does not compose with --pp yet (zero-bubble's W needs the gathered input)"
    if cfg.cp > 1:
        return "--set tp_overlap=true does not compose with --cp (ring attention keeps its own all-gather)"
    if cfg.mixed_precision != "fp32":
        return f"--set tp_overlap=true runs in the model's dtype; drop --mixed-precision {cfg.mixed_precision}"
    return None


def parallelize_tp(model: nn.Module, group, sequence_parallel: bool = False,
                   overlap: bool = False) -> nn.Module:
    """Replace the reference GPT's layers by this rank's tensor-parallel ones (in place).
    `overlap`: SP's collectives decomposed under the matmuls (tp/overlap.py)."""
    t = group_size(group)
    problem = tp_layout_problem(model.cfg, t)
    if problem:
        raise ValueError(problem)
    sp = sequence_parallel and t > 1
    model.embed = VocabParallelEmbedding.from_embedding(model.embed, group, sp)
    for i, block in enumerate(model.blocks):
        block.attn = parallel_attention(block.attn, group, sp, overlap, label=f"tp:blocks.{i}.attn")
        if isinstance(block.mlp, MoEMLP):    # every expert split over tp
            parallelize_moe(block.mlp, group, sp, label=f"tp:blocks.{i}.mlp")
        else:
            block.mlp = parallel_feed_forward(block.mlp, group, sp, overlap, label=f"tp:blocks.{i}.mlp")
    # the output layer reads the final norm's output: full tokens (f) or gathered ones (SP)
    model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group, sequence_parallel=sp,
                                                     pad=True, overlap=overlap)
    if model.cfg.tie_embeddings:   # same vocabulary split and padding: one shard for both
        model.lm_head.weight = model.embed.tok.weight
    for p in sequence_partial(model, sp):
        p.register_hook(functools.partial(all_reduce, group=group))
    return model


def _norm_parameters(model: nn.Module) -> list[nn.Parameter]:
    norms = [model.final_norm] + [n for block in model.blocks for n in (block.ln1, block.ln2)]
    return [p for norm in norms for p in norm.parameters()]


def sequence_partial(model: nn.Module, sequence_parallel: bool) -> list[nn.Parameter]:
    """The replicated parameters of a `parallelize_tp`'d model whose gradient, under SP, covers
    this rank's tokens only: the norms, the row-parallel biases, the position table."""
    if not sequence_parallel:
        return []
    layers = [m for m in model.modules() if isinstance(m, (RowParallelLinear, VocabParallelEmbedding))]
    return _norm_parameters(model) + [p for m in layers for p in m.sequence_partial()]


def tp_lm_loss(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy from this rank's vocabulary slice of the logits (equal to
    refimpl.model.lm_loss on the gathered logits, which are never built)."""
    return tp_loss_for(model.lm_head)(logits, targets)


def tp_loss_for(head: ColumnParallelLinear):
    """`tp_lm_loss` as a function of (logits, targets) holding only the head's group and
    vocabulary slice, not the model (a pipeline's loss must not keep every stage alive)."""
    return functools.partial(_vocab_loss, head.group, head.out_start, head.out_full)


def _vocab_loss(group, out_start: int, vocab: int, logits, targets) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, targets, group, out_start, vocab).mean()


def gather_tp_state_dict(model: nn.Module, group, grads: bool = False) -> dict:
    """The reference model's full state dict (or gradients) rebuilt from the tp ranks' shards."""
    local = ({n: (p.grad if p.grad is not None else torch.zeros_like(p))
              for n, p in model.named_parameters()} if grads else model.state_dict())
    return gather_full_state_dict(local, model, GroupMesh(tp=group))
