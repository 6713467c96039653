"""`FullyShard`: ZeRO-3 / FSDP around any `nn.Module` (a learner's own model)."""
from __future__ import annotations

import torch
import torch.nn as nn

from refimpl.parallel.dp.wrapping import check_devices, claim, named_state, resolve_group
from refimpl.parallel.fsdp.schedule import ShardingPolicy, UnitSchedule, assign_params
from refimpl.seam import dist

WHO = "FullyShard"


class FullyShard(nn.Module):
    """Shards `module`'s parameters unit by unit over `group` (default: the world); `parameters()`
    are this rank's shards, one per unit, each .grad reduced into it."""

    def __init__(self, module: nn.Module, *, group=None, compute_dtype: torch.dtype | None = None,
                 units=None, policy: ShardingPolicy = ShardingPolicy()):
        super().__init__()
        claim(module, WHO)
        group = resolve_group(group, WHO)
        check_devices(named_state(module), group, WHO)
        self.module = module
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        device = trainable[0][1].device if trainable else torch.device("cpu")
        owned, root = assign_params(resolve_units(module, units), trainable)
        self.schedule = UnitSchedule(owned, root, group if dist.get_world_size(group) > 1 else None,
                                     policy, device, compute_dtype)
        self.units = self.schedule.units

    def forward(self, *args, **kwargs):
        root = self.schedule.root
        if root is None:
            return self.module(*args, **kwargs)
        self.schedule.before_forward(root)
        out = self.module(*args, **kwargs)
        self.schedule.after_forward(root, out)
        return out

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's shards, one per unit (what an optimizer steps)."""
        for u in self.units:
            yield (f"{prefix}.{u.name}" if prefix else u.name), u.master

    def finish_gradient_synchronization(self) -> None:
        """Each shard's .grad holds its part of the gradient averaged over the group."""
        self.schedule.finish_gradient_synchronization()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: whole tensor} under the module's names, on the CPU (collective)."""
        by_id: dict[int, torch.Tensor] = {}
        for u in self.units:
            whole = u.full_state_dict()
            by_id.update({id(p): whole[s.name] for s, p in zip(u.flat.slots, u.flat.params)})
        out = {name: by_id[id(p)] if id(p) in by_id else p.detach().cpu().clone()
               for name, p in self.module.named_parameters(remove_duplicate=False)}
        for name, b in self.module.named_buffers():
            out[name] = b.detach().cpu().clone()
        return out


def resolve_units(module: nn.Module, units) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """(unit name, [(prefix, module)]) in forward order. `units`: None (each child holding a
    trainable parameter), module classes and/or names (the outermost wins), or such pairs."""
    if units is None:
        return [(n, [(n, c)]) for n, c in module.named_children()
                if any(p.requires_grad for p in c.parameters())]
    units = list(units)
    if units and isinstance(units[0], tuple):
        return units
    classes = tuple(u for u in units if isinstance(u, type))
    wanted = {u for u in units if isinstance(u, str)}
    known = {n for n, _ in module.named_modules()}
    if wanted - known:
        raise ValueError(f"{WHO}: no submodule named {sorted(wanted - known)}")
    picked: list = []
    for n, m in module.named_modules():
        if not n or any(n.startswith(p + ".") for p, _ in picked):
            continue
        if (classes and isinstance(m, classes)) or n in wanted:
            picked.append((n, m))
    return [(n, [(n, m)]) for n, m in picked]
