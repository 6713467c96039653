"""PyTorch's own tensor parallelism applied to the reference GPT or Llama: the twin of parallelize_tp.

`torch.distributed.tensor.parallel.parallelize_module` turns chosen submodules' parameters into
DTensors and inserts the collectives at module boundaries from a plan, torchtitan-style:

    q, k, v, mlp.up     ColwiseParallel      (weights Shard(0): out_features split)
    mlp.gate            ColwiseParallel      (Llama's SwiGLU: gate and up split alike, so the
                                             product SiLU(gate) * up is channel by channel local)
    o, mlp.down         RowwiseParallel      (weights Shard(1): in_features split)
    embed.tok           RowwiseParallel      (an embedding's rows are the vocabulary)
    lm_head             ColwiseParallel, output kept a DTensor sharded on the vocabulary, so that
                        `loss_parallel()` computes the cross-entropy without gathering the logits
  with sequence parallelism:
    ln1, ln2, final_norm  SequenceParallel   (inputs and outputs sharded on dim 1, the sequence)
    attn, mlp             PrepareModuleInput: Shard(1) -> Replicate() (the all-gather)
    o, mlp.down           output Shard(1) (the reduce-scatter)

Two things the plan cannot see and that we do by hand, as torchtitan does: the attention module
must be told it now holds n_heads/t heads (refimpl.model.attention takes the head count of the
tensors it is given; Llama's grouped-query attention also n_kv_heads/t key/value heads), and our embedding adds a replicated position table after the token lookup,
so under SP the embedding module's output is sliced to this rank's tokens (PrepareModuleOutput:
Replicate -> Shard(1)) rather than reduce-scattered as our VocabParallelEmbedding does (Llama
has no position table; the same slice keeps one plan for both).

Grouped-query attention with fewer key/value heads than tp ranks is not expressible here:
ColwiseParallel cuts W_K and W_V into t equal row blocks, and a head cannot be cut (each rank
would hold part of a head's channels). Ours (tp) gives each rank the whole head its query heads
read and sums its gradient over the ranks sharing it; this plan refuses (`torch_plan_problem`),
as torchtitan asserts n_kv_heads % tp == 0.
"""
from __future__ import annotations

import torch.nn as nn

from refimpl.model.gqa import GroupedQueryAttention
from refimpl.model.swiglu import SwiGLU


def torch_plan_problem(cfg, tp: int) -> str | None:
    """One line naming what this DTensor plan cannot split for a model config, or None."""
    if cfg.arch == "llama" and cfg.kv_heads % tp:
        return (f"PyTorch's DTensor tp plan splits k and v by rows: {cfg.kv_heads} key/value heads "
                f"do not split over tp = {tp} (our tp shares a head: --strategy tp)")
    return None


def torch_parallelize_tp(model: nn.Module, mesh, sequence_parallel: bool = False) -> nn.Module:
    """Apply DTensor tensor parallelism over the 1-D DeviceMesh `mesh` (in place). `model` is the
    reference GPT or one pipeline piece of it (refimpl.parallel.pp.stage.StageChunk: the embedding
    and the head only where that piece has them, its blocks in a ModuleDict)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    t = mesh.size()
    sp = sequence_parallel and t > 1
    between = Shard(1) if sp else Replicate()          # the residual stream's layout between layers
    plan = {}
    if model.embed is not None:
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(),
                                                desired_output_layouts=Shard(1))
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1),
                                          use_local_output=False)
        if sp:
            plan["final_norm"] = SequenceParallel(use_local_output=True)
    if plan:
        parallelize_module(model, mesh, plan)
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    for block in blocks:
        block_plan = {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=between),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=between),
        }
        if isinstance(block.mlp, SwiGLU):
            block_plan["mlp.gate"] = ColwiseParallel()
        if sp:
            block_plan.update({
                "ln1": SequenceParallel(use_local_output=True),
                "ln2": SequenceParallel(use_local_output=True),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, mesh, block_plan)
        block.attn.n_heads //= t
        if isinstance(block.attn, GroupedQueryAttention):
            block.attn.n_kv_heads //= t
    return model


def state_items(model: nn.Module):
    """(reference name, tensor) one at a time: each DTensor gathered with full_tensor() in turn."""
    from torch.distributed.tensor import DTensor

    for name, value in model.state_dict().items():
        yield name, value.full_tensor() if isinstance(value, DTensor) else value


def full_state_dict(model: nn.Module) -> dict:
    """Reference names and shapes, on the CPU: `state_items` kept."""
    return {name: value.detach().cpu().clone() for name, value in state_items(model)}
