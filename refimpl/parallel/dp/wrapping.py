"""The checks every module-level wrapper makes before it touches a model."""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.launch import device_for

_WRAPPED_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # module -> its wrapper


def resolve_group(group, who: str):
    """`group`, or the whole world for None; refuses a group this rank is not in."""
    if not dist.is_initialized():
        raise RuntimeError(f"{who}: torch.distributed is not initialised (call "
                           "init_process_group first; refimpl.launch.run does it on every rank)")
    group = dist.group.WORLD if group is None else group
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(f"{who}: this rank ({dist.get_rank()}) is not in the group it was given")
    return group


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
        owner = _WRAPPED_BY.get(m)
        if owner is not None:
            where = f"its submodule {name!r}" if name else "it"
            raise ValueError(f"{who}: the module is already wrapped ({where} by {owner})")
    _WRAPPED_BY[module] = who


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters and buffers, each tensor once, in state-dict order."""
    return [*module.named_parameters(), *module.named_buffers()]
