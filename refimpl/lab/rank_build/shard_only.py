"""The shard-only build (issue 35): no rank holds the whole model, not even while it is built.

The reference is built on meta (shapes, no storage) and cut there by the model-parallel
transforms; each tensor the rank keeps then gets its value one at a time (the seeded init, or a
checkpoint's part, resharded where the layout differs: refimpl.lab.rank_build.values). ZeRO's flat
buffer and a ZeRO-3/FSDP unit's master shard are storage of their own: such a strategy is set up
on parameters without values (a single zero, broadcast to each parameter's shape) and each
parameter's value is written into that storage afterwards, a ZeRO-3 shard reading only the
parameters that reach into it. It is the CLI's build (refimpl.lab.loop: the loop extras' `place`);
refimpl.train.place_seeded builds the whole reference first, as a learner's script would.
"""
from __future__ import annotations

import contextlib

import torch

from refimpl.compose.transforms import model_parallel
from refimpl.lab.rank_build.values import LocalValues, RankValues, materialize, set_data
from refimpl.model import build_model, converted, count_params
from refimpl.parallel.fsdp.zero3 import FullySharded
from refimpl.parallel.zero.stages import ZeroDataParallel

# the strategies that copy the parameters into storage they keep (the model is handed over without
# its parameters' values: made first, they would be held twice, or whole, while it copies)
OWN_STORAGE = (ZeroDataParallel, FullySharded)


def place_shards(strategy, initial=None, placing=contextlib.nullcontext()) -> int:
    """Build `strategy`'s rank this way and place it; returns the reference's parameter count.
    `initial(reference)`: the state to place instead of the seeded init (a full state dict, or a
    checkpoint's pieces read by parts); `placing`: a context open while the rank's tensors are
    made (the dry run counts it)."""
    ctx, cfg = strategy.ctx, strategy.ctx.cfg
    reference = converted(build_model(cfg.model, cfg.seed, device="meta"), dtype=ctx.param_dtype)
    state = None if initial is None else initial(reference)
    values = RankValues(reference, cfg.seed, ctx.mesh, ctx.device, state)
    n_params = count_params(reference)      # before the transforms cut it in place
    with placing:
        rank_model = strategy.transform(reference, model_parallel)
        module = rank_model.module
        if not isinstance(strategy, OWN_STORAGE):
            materialize(module, values)         # every tensor, one at a time, in place
            strategy.place(rank_model)
            return n_params
        local = values.of(module)               # described while the parameters are shapes
        materialize(module, values, parameters=False)    # the buffers
        for p in module.parameters():
            set_data(p, torch.zeros((), dtype=p.dtype, device=values.device).expand(p.shape))
        strategy.place(rank_model)
        write_values(strategy, local)
    return n_params


@torch.no_grad()
def write_values(strategy, local: LocalValues) -> None:
    """Each parameter's value (`local`: name -> this rank's part) written into the storage the
    strategy keeps, one tensor at a time."""
    if isinstance(strategy, FullySharded):
        for unit in strategy.units:             # only the parameters reaching into its shard
            unit.flat.filled_shard(lambda slot: local[slot.name], unit.rank, out=unit.master.data)
        return
    for part in strategy.groups:                # ZeRO-1/2: the flat buffer every rank holds whole
        optimizer = part.optimizer
        for slot, view in zip(optimizer.layout.slots, optimizer.layout.views(optimizer.flat)):
            view.copy_(local[slot.name].reshape(slot.shape))
        if optimizer.offload:                   # the host's master copy of this rank's shard
            optimizer.master.copy_(optimizer.shard)
