"""`parallelize_tp`: the reference GPT turned, in place, into this rank's tensor-parallel model.

    model = build_model(cfg, seed)                      # the same reference on every rank
    parallelize_tp(model, group, sequence_parallel=sp)  # this rank's slices, reference names kept
    loss = tp_lm_loss(model, model(inputs), targets)    # vocabulary-parallel cross-entropy
    full = gather_tp_state_dict(model, group)           # == single's state dict, key for key

What changes (refimpl.parallel.tp.layers, tp.vocab):
    embed                 VocabParallelEmbedding (token table split by id; positions replicated)
    blocks[i].attn        ParallelSelfAttention  (q, k, v column-parallel by heads, o row-parallel);
                          Llama's ParallelGroupedAttention (k, v by key/value heads, or each
                          rank's one shared head when there are fewer than tp)
    blocks[i].mlp         ParallelMLP            (up column-parallel, down row-parallel); Llama's
                          ParallelSwiGLU (gate, up column-parallel); an MoE layer keeps its
                          router whole and splits each expert so (tp/experts.py)
    lm_head               ColumnParallelLinear over the (padded) vocabulary; logits stay split
    ln1, ln2, final_norm  unchanged and replicated (LayerNorm or RMSNorm)
The Block and GPT forwards are the reference's, untouched: under sequence parallelism the residual
stream between the layers simply holds s/t tokens per rank, which LayerNorm (per token) and the
residual additions (elementwise) do not notice.

Sequence parallelism's one subtlety (Korthikanti et al. 2022, §4.2.2; Megatron marks these
parameters `sequence_parallel` and all-reduces their grads after backward): a replicated weight
applied to the split tokens -- LayerNorm's gain and bias, the row-parallel biases, the position
table -- receives on each rank the gradient of *its* tokens only. The true gradient is the sum over
all tokens, so we sum it over tp with a hook on the parameter (it runs before the gradient is
accumulated into .grad, so micro-batch accumulation stays correct). Without it the replicas would
drift apart after the first step. Without SP the same parameters see every token on every rank and
their gradients are already equal.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.cost.tp_comm import kv_heads_per_rank
from refimpl.model.moe import MoEMLP
from refimpl.model.rmsnorm import RMSNorm
from refimpl.parallel.tp.experts import parallelize_moe
from refimpl.parallel.tp.layers import (
    ColumnParallelLinear,
    parallel_attention,
    parallel_feed_forward,
)
from refimpl.parallel.tp.mappings import (
    all_reduce_grad_logged,
    group_size,
    is_sequence_partial,
    mark_sequence_partial,
)
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
            kv_heads_per_rank(cfg.kv_heads, tp)
        except ValueError as e:
            return str(e)
    if sequence_parallel and seq_len is not None and seq_len % tp:
        return f"--sequence-parallel needs --seq-len ({seq_len}) divisible by --tp {tp}"
    return None


def tp_overlap_problem(cfg) -> str | None:
    """One line naming why `--set tp_overlap=true` cannot run a TrainConfig, or None. The ring
    decomposition replaces sequence parallelism's all-gather and reduce-scatter, so it needs them;
    the pipeline's zero-bubble W reads the gathered input the ring never builds whole
    (ColumnParallelLinear.observe_matmul), and the custom Functions run in the input's dtype."""
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
                   comm=None, sum_norm_grads: bool = True, overlap: bool = False) -> nn.Module:
    """Replace the reference GPT's layers by this rank's tensor-parallel ones (in place).
    `comm`: the collectives module (torch.distributed by default, refimpl.comm for the rebuilt ones).
    `overlap` (`--set tp_overlap=true`, SP only): every column layer's all-gather and row layer's
    reduce-scatter decomposed over the ring under its matmul (tp/overlap.py).
    `sum_norm_grads=False` is notebook 10's fault `sp-norm-unsummed` (refimpl.faults): under SP
    the LayerNorms' gradients then stay partial, one rank's tokens each."""
    comm = comm or dist
    t = group_size(group)
    problem = tp_layout_problem(model.cfg, t)
    if problem:
        raise ValueError(problem)
    sp = sequence_parallel and t > 1
    tied = model.cfg.tie_embeddings
    model.embed = VocabParallelEmbedding.from_embedding(model.embed, group, sp, comm)
    for i, block in enumerate(model.blocks):
        block.attn = parallel_attention(block.attn, group, sp, comm, overlap)
        # forward ranges "tp:blocks.<i>.attn" / ".mlp" around each layer's collectives in a trace
        block.attn.label = f"tp:blocks.{i}.attn"
        if isinstance(block.mlp, MoEMLP):    # every expert split over tp (tp/experts.py)
            parallelize_moe(block.mlp, group, sp, comm, label=f"tp:blocks.{i}.mlp")
        else:
            block.mlp = parallel_feed_forward(block.mlp, group, sp, comm, overlap)
            block.mlp.label = f"tp:blocks.{i}.mlp"
        for norm in (block.ln1, block.ln2):
            _mark_norm(norm, sp)
    _mark_norm(model.final_norm, sp)
    # The output layer reads the final norm's output: full tokens (copy) or gathered ones (SP).
    model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group, sequence_parallel=sp,
                                                     pad=True, comm=comm, overlap=overlap)
    if tied:   # same vocabulary split, same padding: the two modules can share one shard
        model.lm_head.weight = model.embed.tok.weight
    norms = {id(p) for m in model.modules() if isinstance(m, (nn.LayerNorm, RMSNorm))
             for p in m.parameters()}
    for p in model.parameters():
        if is_sequence_partial(p) and (sum_norm_grads or id(p) not in norms):
            p.register_hook(lambda grad: all_reduce_grad_logged(grad, group, comm))
    return model


def _mark_norm(module: nn.Module, sequence_parallel: bool) -> None:
    if sequence_parallel:
        for p in module.parameters():
            mark_sequence_partial(p)


def tp_lm_loss(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor, *,
               mask_padding: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy from this rank's vocabulary slice of the logits (equal to
    refimpl.model.lm_loss on the gathered logits, which are never built). `mask_padding=False`
    is the fault `vocab-unmasked` (refimpl.faults): the padded columns' logits join the softmax."""
    return tp_loss_for(model.lm_head, mask_padding)(logits, targets)


def tp_loss_for(head: nn.Module, mask_padding: bool = True):
    """`tp_lm_loss` as a function of (logits, targets) that keeps only what it reads of the head
    (its group and vocabulary slice), not the model: a loss bound to the whole model kept every
    pipeline stage's blocks alive on every rank (the dry run found 24 GB of them on rank 0 of a
    70B tp8 x pp4 layout)."""
    return functools.partial(_vocab_loss, head.group, head.out_start,
                             head.out_full if mask_padding else None, head.comm)


def _vocab_loss(group, out_start, out_full, comm, logits, targets) -> torch.Tensor:
    vocab = out_full if out_full is not None else logits.shape[-1] * group_size(group)
    return vocab_parallel_cross_entropy(logits, targets, group, out_start, vocab, comm).mean()


def gather_tp_state_dict(model: nn.Module, group, grads: bool = False) -> dict:
    """The reference model's full state dict (or gradients) rebuilt from the tp ranks' shards,
    with refimpl.placement's one gather (here on an explicit group, not a mesh)."""
    local = ({n: (p.grad if p.grad is not None else torch.zeros_like(p))
              for n, p in model.named_parameters()} if grads else model.state_dict())
    return gather_full_state_dict(local, model, GroupMesh(tp=group), dist)
