"""The reference model's full state dict, reassembled from any layout's rank (what checkpoints,
exports and the equivalence checks compare), and its inverse: one rank's part of a full tensor.

Each parameter's placement (refimpl.placement: a Shard over tp, a module Owned over ep) says how:
a Shard's parts are all-gathered along its dim, an owned module's copies gathered over its axis
and renamed to each owner's index; under a pipeline each stage holds some of the names."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from refimpl.placement import Owned, Placement, Shard, placement_of
from refimpl.seam import dist


def placements(model: nn.Module) -> dict[str, Placement]:
    """State-dict name -> placement, for the model's sharded parameters and buffers."""
    found = {}
    # remove_duplicate=False: a tied weight (lm_head = embed.tok) is in the state dict under both
    # names, and both must be unsharded.
    for name, t in (list(model.named_parameters(remove_duplicate=False))
                    + list(model.named_buffers())):
        p = placement_of(t)
        if p is not None:
            found[name] = p
    return found


def unshard(tensor: torch.Tensor, shard: Shard, mesh) -> torch.Tensor:
    """All-gather `tensor`'s parts over `shard.axis` along `shard.dim`; cut to the reference size."""
    group_size = mesh.size(shard.axis)
    if group_size > 1:
        parts = [torch.empty_like(tensor) for _ in range(group_size)]
        dist.all_gather(parts, tensor.contiguous(), group=mesh.group(shard.axis))
        tensor = torch.cat(parts[::shard.repeats], dim=shard.dim)
    return tensor.narrow(shard.dim, 0, shard.full)


def local_part(full: torch.Tensor, shape, where: Placement | None, mesh) -> torch.Tensor:
    """The part of a reference-shaped tensor this rank holds, of shape `shape` (the inverse of
    `unshard`): a Shard's slice of its dim, zero-padded as a padded vocabulary is; an owned
    expert is under its own name on its owner, so only a Shard inside it remains to cut."""
    if isinstance(where, Owned):
        where = where.within
    if where is None:
        return full
    size, n = shape[where.dim], mesh.size(where.axis) // where.repeats
    pad = size * n - full.shape[where.dim]
    if pad:
        widths = [0, 0] * (full.dim() - 1 - where.dim) + [0, pad]
        full = F.pad(full, widths)
    return full.narrow(where.dim, mesh.index(where.axis) // where.repeats * size, size)


def gather_full_state_dict(local: dict[str, torch.Tensor], model: nn.Module, mesh,
                           sharded: dict[str, Placement] | None = None
                           ) -> dict[str, torch.Tensor]:
    """The reference's full state dict on every rank, from this rank's `local` state dict.
    `sharded`: the placements, where the model's tensors no longer carry them (`placements`)."""
    full = {name: t.cpu().clone() for name, t in full_state_items(local, model, mesh, sharded)}
    return merge_stages(full, mesh) if mesh.size("pp") > 1 else full


def full_state_items(local, model: nn.Module, mesh, sharded: dict[str, Placement] | None = None):
    """(reference name, full tensor) of this pipeline stage, one at a time, in the same order on
    every rank (the all-gathers must match); `local[name]` is read as its turn comes."""
    sharded = placements(model) if sharded is None else sharded
    # an owned module's names sort by its slot, which every owner shares, not by its index
    for name in sorted(local, key=lambda n: _canonical(n, sharded.get(n), mesh)):
        tensor, where = local[name].detach(), sharded.get(name)
        if isinstance(where, Owned):
            if where.within is not None:     # first the owner's whole module (e.g. over tp)
                tensor = unshard(tensor, where.within, mesh)
            yield from gather_owned(name, tensor, where, mesh).items()
        else:
            yield name, tensor if where is None else unshard(tensor, where, mesh)
        del tensor                           # before the next is gathered: one at a time


def _canonical(name: str, where: Placement | None, mesh) -> str:
    if isinstance(where, Owned):
        return renamed(where, name, slot(where, mesh.size(where.axis)))
    return name


def slot(owned: Owned, axis_size: int) -> int:
    """An owned module's place among its owner's modules (the owner: the index // per-rank count)."""
    return owned.index % (owned.count // axis_size)


def renamed(owned: Owned, name: str, index: int) -> str:
    """`name` with the owned module's index replaced by `index` (the same slot on another rank)."""
    return name.replace(f"{owned.segment}.{owned.index}.", f"{owned.segment}.{index}.", 1)


def gather_owned(name: str, tensor: torch.Tensor, owned: Owned, mesh) -> dict[str, torch.Tensor]:
    """Every owner's module in this slot: one all-gather over `owned.axis`, renamed to each
    owner's index (rank r of the axis owns indices [r·count/size, (r+1)·count/size))."""
    size = mesh.size(owned.axis)
    if size == 1:
        return {name: tensor}
    copies = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(copies, tensor.contiguous(), group=mesh.group(owned.axis))
    per, mine = owned.count // size, slot(owned, size)
    return {renamed(owned, name, owner * per + mine): t for owner, t in enumerate(copies)}


def merge_stages(stage_state: dict[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    """Under a pipeline each stage holds some of the names: the union over the pp group."""

    every: list = [None] * mesh.size("pp")
    dist.all_gather_object(every, stage_state, group=mesh.group("pp"))
    merged = {}
    for part in every:
        merged.update(part)
    return merged
