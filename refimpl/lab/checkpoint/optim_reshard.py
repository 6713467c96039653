"""AdamW's m and v, resharded: the optimizer's half of a checkpoint that moves between layouts.

The weights of a checkpoint are the reference's full state dict (refimpl.lab.verify.reshard). AdamW
also keeps, per parameter element, a first moment m (exp_avg) and a second moment v (exp_avg_sq),
and a step count for the bias correction (Loshchilov & Hutter 2019, Alg. 2; Kingma & Ba 2015, Alg.
1). Written the same way -- reference names and full shapes -- they too load under any layout, and
the resumed run is the uninterrupted one, not a run whose optimizer restarts from zero.

Where each layout keeps m and v, and how it is made whole (`full_optimizer_state`):
  plain AdamW (dp-naive, dp, tp, pp-*, single)   per parameter, shaped like this rank's slice
  zero1 / zero2 (ShardedOptimizer, flat)         a flat shard over dp x cp of the flat parameters
  zero3 / fsdp (FullySharded)                    one flat shard per unit over dp x cp
(a MoE model under --ep: the experts' flat shards over edp, beside the dense ones)
The flat shards are all-gathered over their group and cut back into parameters (FlatParams); then
the same unsharding as the weights (placement.gather_full_state_dict: tp slices, experts over ep,
pipeline stages).
`load_optimizer_state` is the inverse: each parameter's m and v cut to this rank's tp slice (the
padded vocabulary padded with zeros, as its weights are), kept if this stage holds it, flattened
and sharded the way this layout's optimizer holds them.
"""
from __future__ import annotations

import torch

from refimpl.lab.checkpoint.gather import gather_full_state_dict, placements
from refimpl.lab.checkpoint.sharded_optimizer_state import gathered
from refimpl.lab.rank_build.values import part_of
from refimpl.mesh import LayoutError
from refimpl.parallel.fsdp.zero3 import FullySharded
from refimpl.parallel.zero.stages import ZeroDataParallel

MOMENTS = ("exp_avg", "exp_avg_sq")
# PyTorch's twins keep DTensor moments (their checkpoints go through DCP instead,
# refimpl.lab.checkpoint.dcp_checkpoint). `ep` is dp-naive over --ep (refimpl.registry), whose experts'
# moments are placed like their weights, as every flavour's are under --ep.
UNSUPPORTED_PREFIXES = ("torch-",)


def validate_optimizer_state(cfg, flag: str = "--init/--save-optimizer-state") -> None:
    """Before launch: optimizer-state resharding is built for our AdamW strategies only."""
    if cfg.strategy.startswith(UNSUPPORTED_PREFIXES):
        raise LayoutError(f"{flag}: not for {cfg.strategy!r} (its optimizer "
                          "state is not resharded; --save-state / --init-state carry the weights)")
    if cfg.options.get("offload"):
        raise LayoutError(f"{flag}: not with --set offload=true")


def _holders(strategy):
    """[(optimizer, master tensor, FlatParams or None, group, index, names)] for a strategy: where
    its AdamW states live. names: the parameter names of a plain (non-flat) master."""
    if isinstance(strategy, FullySharded):               # zero3 / fsdp: every group's units
        return [(strategy.optimizer, u.master, u.flat, u.group, u.rank, None)
                for u in strategy.units]
    if isinstance(strategy, ZeroDataParallel):           # zero1 / zero2: one per group
        return [(part.optimizer.local, part.optimizer.master, part.layout, part.group,
                 part.index, None) for part in strategy.groups]
    if isinstance(strategy.optimizer, torch.optim.AdamW):
        owned = {id(p) for g in strategy.optimizer.param_groups for p in g["params"]}
        named = [(n, p) for n, p in strategy.model.named_parameters() if id(p) in owned]
        if len(named) != len(owned):
            raise NotImplementedError(f"{strategy.name}: its optimizer's tensors are not the "
                                      "model's parameters")
        return [(strategy.optimizer, p, None, None, 0, n) for n, p in named]
    raise NotImplementedError(f"{strategy.name}: optimizer-state resharding is not supported")


def full_optimizer_state(strategy) -> dict:
    """{"step": int, "exp_avg": {name: full tensor}, "exp_avg_sq": {...}} under the reference's
    names and shapes, on every rank. Collective over every axis (every rank calls it)."""
    local: dict[str, dict] = {m: {} for m in MOMENTS}
    step = 0
    for opt, master, flat, group, _, name in _holders(strategy):
        state = opt.state[master]
        step = int(state["step"])
        for m in MOMENTS:
            if flat is None:
                local[m][name] = state[m].detach()
            else:
                whole = gathered(flat, state[m].detach(), group)
                local[m].update(flat.state_dict(whole))
    full = {m: gather_full_state_dict(local[m], strategy.model, strategy.mesh)
            for m in MOMENTS}
    return {"step": step, **full}


def load_optimizer_state(strategy, saved: dict) -> None:
    """Place a `full_optimizer_state` (from any layout) into this strategy's optimizer."""
    sharded = placements(strategy.model)
    mesh = strategy.mesh

    def local(m, name, shape, device, dtype):   # in the master's dtype (fp32 saved, float64 run)
        return part_of(saved[m], name, shape, sharded.get(name), mesh).to(device, dtype)

    for opt, master, flat, _, index, name in _holders(strategy):
        if flat is None:
            moments = {m: local(m, name, master.shape, master.device, master.dtype).clone()
                       for m in MOMENTS}
        else:   # this rank's shard only, one parameter's moment read at a time (never the
                # whole flat buffer: ZeRO-1/2's spans the model)
            moments = {m: flat.filled_shard(
                lambda s, m=m: local(m, s.name, s.shape, master.device, master.dtype),
                index, dtype=master.dtype, device=master.device) for m in MOMENTS}
        opt.state[master] = {"step": torch.tensor(float(saved["step"])), **moments}
