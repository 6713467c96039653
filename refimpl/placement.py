"""Where each parameter lives: one record per parameter (a Shard of a tensor-parallel cut, a module
Owned by an expert-parallel rank), kept beside the tensor, never on it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

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


Placement = Shard | Owned


def set_placement(tensor: torch.Tensor, placement: Placement | None) -> None:
    if placement is None:
        _PLACEMENTS.pop(tensor, None)
    else:
        _PLACEMENTS[tensor] = placement


def placement_of(tensor: torch.Tensor) -> Placement | None:
    return _PLACEMENTS.get(tensor)


# A ZeRO-3/FSDP parameter (refimpl.parallel.fsdp): whole only while its unit is gathered, so a
# pipeline's backward keeps its W split on a chunk holding one (docs/core_notes.md, placement).
_RESHARDED = WeakIdKeyDictionary()


def mark_resharded(tensor: torch.Tensor) -> None:
    _RESHARDED[tensor] = True


def is_resharded(tensor: torch.Tensor) -> bool:
    return _RESHARDED.get(tensor, False)


def data_parallel_axis(tensor: torch.Tensor) -> str:
    """The group over which a parameter's gradient is summed (and a ZeRO/FSDP shard cut): the
    ranks holding the same copy of it: "dp_cp", or for an expert (Owned over ep) "edp", the ranks
    holding the same experts (over dp_cp expert 0's gradient would land in expert 2's weights)."""
    where = placement_of(tensor)
    return "edp" if isinstance(where, Owned) and where.axis == "ep" else "dp_cp"
