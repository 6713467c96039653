"""A rank's model is the reference model transformed, in one fixed order (torchtitan's):

    pipeline split -> tensor / sequence parallel -> expert parallel -> activation checkpointing
    -> data-parallel wrapping (the strategy's own: replicate, or shard over dp x cp)

`model_parallel` applies everything before the data-parallel wrapping; every strategy's `setup`
starts with it, so each transform is applied in one place. Each transform is a function of the
module, its axis's process group and its options, readable alone in its own file.
"""
from __future__ import annotations

import torch.nn as nn

from refimpl.mesh import LayoutError
from refimpl.parallel.checkpointing import checkpoint_blocks

# Axes whose transform exists; each model-parallel chapter adds its own with its validation.
BUILT_AXES: tuple[str, ...] = ()


def validate_model_parallel(cfg) -> None:
    """The model-parallel constraints of a layout, checked before launch (one line each)."""
    for axis in ("tp", "pp", "cp"):
        if getattr(cfg, axis) > 1 and axis not in BUILT_AXES:
            raise LayoutError(f"--{axis} {getattr(cfg, axis)}: this axis has no transform yet")
    from refimpl.parallel.moe import validate_moe

    validate_moe(cfg.model, cfg.dims.ep)
    if cfg.dims.ep > 1 and cfg.strategy != "ep":
        # Every other data-parallel flavour would average different experts' gradients over dp.
        raise LayoutError(f"--ep {cfg.dims.ep} runs with --strategy ep (its data-parallel sync "
                          "keeps expert gradients on the ranks holding the same experts)")


def model_parallel(model: nn.Module, ctx) -> nn.Module:
    """This rank's share of the reference model, on its device, before data parallelism."""
    model = model.to(ctx.device)
    if ctx.mesh.size("ep") > 1:
        from refimpl.parallel.expert_parallel import parallelize_experts

        # Tokens come from every dp x cp rank (the capacity is global); experts move over "ep".
        parallelize_experts(model, ctx.mesh.group("ep"), ctx.mesh.group("dp_cp"), comm=ctx.comm)
    if ctx.cfg.activation_checkpointing:
        checkpoint_blocks(model)
    return model
