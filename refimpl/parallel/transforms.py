"""A rank's model is the reference model transformed, in one fixed order:

    tensor / sequence parallel -> context parallel (ring attention) -> expert parallel
    -> activation checkpointing -> pipeline split
    -> data-parallel wrapping (the strategy's own: replicate, or shard over dp x cp)

torchtitan cuts the pipeline first and then parallelizes each stage; here every transform works
on the whole reference model in place (parameter names stay the reference's) and the pipeline
split comes last, keeping the blocks of this rank's stage. The result is the same model: each
transform touches only its own modules. `model_parallel` applies everything before the
data-parallel wrapping; every strategy's `setup` starts with it, so each transform is applied in
one place. Each transform is a function of the module, its axis's process group and its options,
readable alone in its own file (tp_model.py, cp_model.py, expert_parallel.py, checkpointing.py,
pp_stage.py); `validate_model_parallel` checks their constraints before any rank starts.
"""
from __future__ import annotations

import torch.nn as nn

from refimpl.mesh import LayoutError
from refimpl.parallel.checkpointing import checkpoint_blocks

# Axes whose transform exists; each model-parallel chapter adds its own with its validation.
BUILT_AXES: tuple[str, ...] = ("tp", "pp", "cp")


def validate_model_parallel(cfg) -> None:
    """The model-parallel constraints of a layout, checked before launch (one line each)."""
    for axis in ("tp", "pp", "cp"):
        if getattr(cfg, axis) > 1 and axis not in BUILT_AXES:
            raise LayoutError(f"--{axis} {getattr(cfg, axis)}: this axis has no transform yet")
    if cfg.cp > 1 and cfg.seq_len % (2 * cfg.cp):
        raise LayoutError(f"--seq-len {cfg.seq_len} must be divisible by 2 x cp = {2 * cfg.cp}: "
                          "ring attention cuts each sequence into 2·cp equal chunks")
    from refimpl.parallel.moe import validate_moe

    validate_moe(cfg.model, cfg.dims.ep)
    if cfg.dims.ep > 1 and cfg.strategy != "ep":
        # Every other data-parallel flavour would average different experts' gradients over dp.
        raise LayoutError(f"--ep {cfg.dims.ep} runs with --strategy ep (its data-parallel sync "
                          "keeps expert gradients on the ranks holding the same experts)")
    if cfg.model.n_experts and (cfg.pp > 1 or cfg.cp > 1):
        # pp: the schedules' loss has no MoE auxiliary loss yet; cp: a rank's tokens are not a
        # contiguous run of the batch, so the capacity's batch order would differ from single's.
        raise LayoutError("--experts with --pp or --cp is not supported yet (MoE runs on dp/ep)")
    if cfg.tp > 1 and cfg.model.n_experts:
        raise LayoutError("--tp with --experts: the expert MLPs are not split over tp yet")
    if cfg.sequence_parallel and cfg.tp == 1:
        raise LayoutError("--sequence-parallel needs --tp > 1 (it splits what tensor parallelism "
                          "leaves replicated)")
    if cfg.tp > 1 and cfg.cp > 1:
        raise LayoutError("--tp with --cp: ring attention over tensor-parallel heads is not built "
                          "(use one of them)")
    if cfg.tp > 1:
        from refimpl.parallel.tp_model import tp_layout_problem

        problem = tp_layout_problem(cfg.model, cfg.tp, cfg.seq_len, cfg.sequence_parallel)
        if problem:
            raise LayoutError(problem)
    from refimpl.parallel.pp_strategy import validate_pipeline

    validate_pipeline(cfg)


def model_parallel(model: nn.Module, ctx) -> nn.Module:
    """This rank's share of the reference model, on its device, before data parallelism."""
    model = model.to(ctx.device)
    if ctx.mesh.size("tp") > 1:
        from refimpl.parallel.tp_model import parallelize_tp

        parallelize_tp(model, ctx.mesh.group("tp"), sequence_parallel=ctx.cfg.sequence_parallel,
                       comm=ctx.comm)
    if ctx.cfg.cp > 1:   # ring attention in every block, global positions (parallel/cp_model.py)
        from refimpl.parallel.cp_model import apply_context_parallel
        apply_context_parallel(model, ctx.mesh.group("cp"))
    if ctx.mesh.size("ep") > 1:
        from refimpl.parallel.expert_parallel import parallelize_experts

        # Tokens come from every dp x cp rank (the capacity is global); experts move over "ep".
        parallelize_experts(model, ctx.mesh.group("ep"), ctx.mesh.group("dp_cp"), comm=ctx.comm)
    elif ctx.cfg.model.n_experts and ctx.mesh.size("dp_cp") > 1:
        from refimpl.parallel.expert_parallel import share_routing_counts

        share_routing_counts(model, ctx.mesh.group("dp_cp"), comm=ctx.comm)   # global capacity
    if ctx.cfg.activation_checkpointing:
        checkpoint_blocks(model)     # before the split: it replaces each block's forward in place
    if ctx.mesh.size("pp") > 1:
        from refimpl.parallel.pp_stage import split_for_pipeline

        model = split_for_pipeline(model, ctx)
    return model
