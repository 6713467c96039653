"""Where each parameter lives, one record per parameter, and one function that reassembles the
reference model's full state dict from any layout."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from refimpl.seam import dist

# tensor -> its Placement, for as long as the tensor object lives (swap_tensors keeps the object)
_PLACEMENTS = WeakIdKeyDictionary()


@dataclass(frozen=True)
class Shard:
    axis: str          # a mesh axis: "tp", "ep", ...
    dim: int           # the tensor dimension cut over that axis
    full: int          # the reference's size of that dimension
    # each part held by `repeats` consecutive ranks of the axis: grouped-query attention's K/V
    # heads when there are fewer of them than tp ranks (refimpl.parallel.tp.layers)
    repeats: int = 1


@dataclass(frozen=True)
class Owned:
    axis: str          # a mesh axis: "ep"
    segment: str       # the name segment before the index: "experts" in "...mlp.experts.5.up.weight"
    index: int         # this module's index in the reference
    count: int         # how many the reference has (E); each rank of the axis owns count / size
    within: Shard | None = None   # the owned module's own tensor split too (tp inside an expert)

    def slot(self, axis_size: int) -> int:
        """Its place among its owner's modules (the owner is the rank index // per-rank count)."""
        return self.index % (self.count // axis_size)

    def renamed(self, name: str, index: int) -> str:
        """`name` with this module's index replaced by `index` (the same slot on another rank)."""
        return name.replace(f"{self.segment}.{self.index}.", f"{self.segment}.{index}.", 1)


Placement = Shard | Owned


def set_placement(tensor: torch.Tensor, placement: Placement | None) -> None:
    if placement is None:
        _PLACEMENTS.pop(tensor, None)
    else:
        _PLACEMENTS[tensor] = placement


def placement_of(tensor: torch.Tensor) -> Placement | None:
    return _PLACEMENTS.get(tensor)


# A ZeRO-3/FSDP parameter (refimpl.parallel.fsdp): its full value exists only while its unit is
# gathered, and the unit is freed once a backward (or a split schedule's W) has delivered its
# gradients. A pipeline's zero bubble (refimpl.parallel.pp.zero_bubble) keeps the split W on a chunk
# holding one: that W reads no weight, where the whole backward it runs on other first pieces
# rereads the weights autograd saved in the forward.
_RESHARDED = WeakIdKeyDictionary()


def mark_resharded(tensor: torch.Tensor) -> None:
    _RESHARDED[tensor] = True


def is_resharded(tensor: torch.Tensor) -> bool:
    return _RESHARDED.get(tensor, False)


def data_parallel_axis(tensor: torch.Tensor) -> str:
    """The group over which a parameter's gradient is summed (and a ZeRO/FSDP shard cut): the
    ranks holding the same copy of it. Every replicated or tp/pp-split parameter: "dp_cp". A
    module owned over ep (an expert): "edp", the ranks of the other ep chunks holding the same
    experts -- summing over dp_cp would add expert 0's gradient into expert 2's weights
    (Megatron-core keeps expert parameters in their own buffers over the expert-data-parallel
    group for that reason; its distributed optimizer shards them there)."""
    where = placement_of(tensor)
    return "edp" if isinstance(where, Owned) and where.axis == "ep" else "dp_cp"


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
        return where.renamed(name, where.slot(mesh.size(where.axis)))
    return name


def gather_owned(name: str, tensor: torch.Tensor, owned: Owned, mesh) -> dict[str, torch.Tensor]:
    """Every owner's module in this slot: one all-gather over `owned.axis`, renamed to each
    owner's index (rank r of the axis owns indices [r·count/size, (r+1)·count/size))."""
    size = mesh.size(owned.axis)
    if size == 1:
        return {name: tensor}
    copies = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(copies, tensor.contiguous(), group=mesh.group(owned.axis))
    per, slot = owned.count // size, owned.slot(size)
    return {owned.renamed(name, owner * per + slot): t for owner, t in enumerate(copies)}


def merge_stages(stage_state: dict[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    """Under a pipeline each stage holds some of the names: the union over the pp group."""

    every: list = [None] * mesh.size("pp")
    dist.all_gather_object(every, stage_state, group=mesh.group("pp"))
    merged = {}
    for part in every:
        merged.update(part)
    return merged
