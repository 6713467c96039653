"""What every module-level wrapper checks before it touches a model: the bad uses, in one line.

DataParallel, ShardedOptimizer and FullyShard (a user's own model and optimizer, the way PyTorch's
DistributedDataParallel, ZeroRedundancyOptimizer and fully_shard are used) each start here, so a
mistake fails at construction with the constraint named, not later as a hang or a wrong number:

  * torch.distributed is not initialised (refimpl.launch.run initialises it on every rank);
  * the group does not contain this rank (torch.distributed.new_group hands non-members a
    placeholder: a collective on it would wait for ever or fail far away);
  * a tensor is on another device than the group's backend wants (NCCL: the rank's GPU; gloo:
    the CPU) -- gloo would forgive some of it, NCCL would not (refimpl's rule: NCCL's rules hold);
  * a module is wrapped a second time, or inside another wrapper: two sets of hooks would reduce
    each gradient twice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.launch import device_for

_WRAPPED = "_refimpl_wrapped_by"     # set and read by `claim` only


def resolve_group(group, who: str):
    """`group`, or the whole world for None (torch.distributed's convention); refuses a group
    this rank is not in."""
    if not dist.is_initialized():
        raise RuntimeError(f"{who}: torch.distributed is not initialised (call "
                           "init_process_group first; refimpl.launch.run does it on every rank)")
    group = dist.group.WORLD if group is None else group
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(f"{who}: this rank ({dist.get_rank()}) is not in the group it was given")
    return group


def group_size(group) -> int:
    return dist.get_world_size(group)


def check_devices(tensors, group, who: str) -> None:
    """Every tensor on the device type the group's backend communicates from."""
    wanted = device_for(dist.get_backend(group)).type
    for name, t in tensors:
        if t.device.type != wanted:
            raise ValueError(f"{who}: {name} is on {t.device}, but the group's backend "
                             f"({dist.get_backend(group)}) wants {wanted} tensors")


def claim(module: nn.Module, who: str) -> None:
    """Mark `module` as wrapped by `who`; refuses one that is, or that holds one that is."""
    for name, m in module.named_modules():
        owner = getattr(m, _WRAPPED, None)
        if owner is not None:
            where = f"its submodule {name!r}" if name else "it"
            raise ValueError(f"{who}: the module is already wrapped ({where} by {owner})")
    setattr(module, _WRAPPED, who)


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters and buffers, each tensor once, in state-dict order."""
    return [*module.named_parameters(), *module.named_buffers()]
