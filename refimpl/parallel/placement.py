"""Where each parameter of a rank's model lives, recorded on the parameter itself.

A model transformed for tensor parallelism (or any axis that slices tensors) keeps the reference's
parameter names, and each parameter carries a `Placement`:

    Shard(dim=d, axis="tp", full_size=n)   this rank holds the r-th of t equal slices of dim d of a
                                           reference tensor whose dim d has n entries (the last
                                           slice may end in zero padding: a vocabulary tp does
                                           not divide)
    Replicate(axis="tp", sequence_partial) every rank holds all of it; with sequence_partial its
                                           gradient on each rank covers only this rank's tokens
                                           (sequence parallelism) and must be summed over the axis

so `gather_full_state_dict` can rebuild the reference state dict from any rank's pieces without
knowing which layer did what (DESIGN: "one function gathers any layout's full state dict").
Megatron keeps the same facts as attributes `tensor_model_parallel`, `partition_dim`, and
`sequence_parallel` on its parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ATTR = "placement"


@dataclass(frozen=True)
class Placement:
    kind: str                    # "shard" or "replicate"
    axis: str = "tp"
    dim: int | None = None       # shard: the sliced dimension
    full_size: int | None = None  # shard: that dimension's size in the reference (before padding)
    sequence_partial: bool = False  # replicate: gradient partial over the sequence (SP)


def sharded(p: torch.Tensor, dim: int, full_size: int, axis: str = "tp") -> torch.Tensor:
    setattr(p, ATTR, Placement("shard", axis, dim, full_size))
    return p


def replicated(p: torch.Tensor, axis: str = "tp", sequence_partial: bool = False) -> torch.Tensor:
    setattr(p, ATTR, Placement("replicate", axis, sequence_partial=sequence_partial))
    return p


def placement_of(p: torch.Tensor) -> Placement:
    """A parameter nobody marked is replicated: the reference layout."""
    return getattr(p, ATTR, None) or Placement("replicate")


def gather_full(local: torch.Tensor, placement: Placement, group) -> torch.Tensor:
    """The reference tensor from this rank's piece: all-gather the slices of a sharded dim, trim
    the padding. Collective over `group` for a shard; a replicated tensor is returned as is."""
    local = local.detach()
    if placement.kind != "shard" or group is None or dist.get_world_size(group) == 1:
        full = local
    else:
        front = local.movedim(placement.dim, 0).contiguous()
        out = torch.empty((dist.get_world_size(group) * front.shape[0],) + front.shape[1:],
                          dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(out, front, group=group)
        full = out.movedim(0, placement.dim)
    if placement.kind == "shard":
        full = full.narrow(placement.dim, 0, placement.full_size)
    return full.cpu().clone()


def gather_full_state_dict(model: torch.nn.Module, groups: dict, grads: bool = False) -> dict:
    """Reference-named, reference-shaped copies of every parameter (or its gradient) on CPU.

    `groups` maps an axis name ("tp") to this rank's process group on it. Collective: every rank of
    each group calls it, in the same parameter order, and gets the same dict.
    """
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in out:
            continue
        place = placement_of(p)
        tensor = p.grad if grads else p
        if tensor is None:
            tensor = torch.zeros_like(p)
        out[name] = gather_full(tensor, place, groups.get(place.axis))
    return out
