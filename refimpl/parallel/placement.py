"""Where each parameter lives, recorded on the parameter, and one function that reassembles the
reference model's full state dict from any layout.

A transform that slices or moves a parameter says so once, with `set_placement`:

    replicated             every rank of the axis holds the whole tensor (the default: DP)
    Shard(axis, dim, full) this rank holds its part of dim `dim`, cut evenly over `axis`'s group;
                           `full` is the reference size of that dim (a padded vocabulary is
                           longer on the ranks than in the reference, and is cut back)
    stage-local            under a pipeline a rank holds only its stage's parameters: the full
                           state dict is the union over the pp group

`gather_full_state_dict` applies these in one order -- undo the shards (all-gather over their
axis), then merge the pipeline stages -- so ZeRO-3 (which first reassembles each unit's flat
buffer over dp) and every model-parallel axis share it, and any checkpoint reshards onto any
other layout: a checkpoint is always the reference's state dict.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from refimpl.trace.profiling import comm_span

ATTRIBUTE = "_refimpl_placement"


@dataclass(frozen=True)
class Shard:
    axis: str          # a mesh axis: "tp", "ep", ...
    dim: int           # the tensor dimension cut over that axis
    full: int          # the reference's size of that dimension


def set_placement(tensor: torch.Tensor, placement: Shard | None) -> None:
    setattr(tensor, ATTRIBUTE, placement)


def placement_of(tensor: torch.Tensor) -> Shard | None:
    return getattr(tensor, ATTRIBUTE, None)


def placements(model: nn.Module) -> dict[str, Shard]:
    """State-dict name -> Shard, for the model's sharded parameters and buffers."""
    found = {}
    # remove_duplicate=False: a tied weight (lm_head = embed.tok) is in the state dict under both
    # names, and both must be unsharded.
    for name, t in (list(model.named_parameters(remove_duplicate=False))
                    + list(model.named_buffers())):
        p = placement_of(t)
        if p is not None:
            found[name] = p
    return found


def unshard(tensor: torch.Tensor, shard: Shard, mesh, comm) -> torch.Tensor:
    """All-gather `tensor`'s parts over `shard.axis` along `shard.dim`; cut to the reference size."""
    group_size = mesh.size(shard.axis)
    if group_size > 1:
        parts = [torch.empty_like(tensor) for _ in range(group_size)]
        with comm_span("all_gather", tensor.nbytes * group_size):
            comm.all_gather(parts, tensor.contiguous(), group=mesh.group(shard.axis))
        tensor = torch.cat(parts, dim=shard.dim)
    return tensor.narrow(shard.dim, 0, shard.full)


def gather_full_state_dict(local: dict[str, torch.Tensor], model: nn.Module, mesh,
                           comm) -> dict[str, torch.Tensor]:
    """The reference's full state dict on every rank, from this rank's `local` state dict.

    Collective over every axis the model is sharded on (every rank must call it)."""
    sharded = placements(model)
    full = {}
    for name in sorted(local):   # the same order on every rank: the all-gathers must match
        tensor = local[name].detach()
        if name in sharded:
            tensor = unshard(tensor, sharded[name], mesh, comm)
        full[name] = tensor.cpu().clone()
    if mesh.size("pp") > 1:
        full = merge_stages(full, mesh)
    return full


def merge_stages(stage_state: dict[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    """Under a pipeline each stage holds some of the names: the union over the pp group."""
    import torch.distributed as dist

    every: list = [None] * mesh.size("pp")
    dist.all_gather_object(every, stage_state, group=mesh.group("pp"))
    merged = {}
    for part in every:
        merged.update(part)
    return merged
