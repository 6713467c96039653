"""`ShardedOptimizer`: ZeRO-1's partitioned optimizer states for any model (Rajbhandari et al.
2020, §5.1, P_os): each element's owner alone keeps its state, steps it, sends the new value.

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)   # or partition="flat"
"""
from __future__ import annotations

import torch
import torch.nn as nn

from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.wrapping import check_devices, resolve_group
from refimpl.seam import dist, plugins

PARTITIONS = ("tensors", "flat")
WHO = "ShardedOptimizer"


class ShardedOptimizer(torch.optim.Optimizer):
    """`optimizer_cls(**defaults)` over this rank's partition of `params` over `group` (default:
    the world). `alone`: one shard, this rank's (a group of one, or none)."""

    def __init__(self, params, optimizer_cls, *, group=None, partition="tensors", offload=False,
                 alone=False, **defaults):
        if partition not in PARTITIONS:
            raise ValueError(f"{WHO}: partition must be one of {PARTITIONS}, got {partition!r}")
        if offload and partition != "flat":
            raise ValueError(f"{WHO}: offload=True needs partition='flat' (the host holds one "
                             "flat shard)")
        self.partition, self.offload = partition, offload
        self.group = resolve_group(group, WHO)
        self.rank, self.world_size = ((0, 1) if alone else
                                      (dist.get_rank(self.group), dist.get_world_size(self.group)))
        self.owner: dict[int, int] = {}          # tensors: id(parameter) -> its owner's rank
        self._load = [0] * self.world_size       # tensors: elements each rank owns
        self.local: torch.optim.Optimizer | None = None
        super().__init__(params, defaults)       # calls add_param_group for each group
        check_devices([(f"parameter {i}", p) for i, p in enumerate(self.all_params())],
                      self.group, WHO)
        if partition == "flat":
            self._lay_out_flat()
            groups = [{**settings_of(self.param_groups[0]), "params": [self.master]}]
        else:
            groups = [self._local_group(g) for g in self.param_groups]
        self.local = optimizer_cls(groups, **defaults)
        # the class's defaults (Adam's betas...) shown here too, for the state dict and a scheduler
        self.defaults = self.local.defaults
        for g in self.param_groups:
            for k, v in self.defaults.items():
                g.setdefault(k, v)

    def add_param_group(self, param_group: dict) -> None:
        if self.partition == "flat" and self.param_groups:
            raise ValueError(f"{WHO}: partition='flat' takes one parameter group (a flat shard "
                             "mixes parameters, so they share their hyper-parameters)")
        super().add_param_group(param_group)
        if self.partition == "flat":
            return
        group = self.param_groups[-1]
        for p in sorted((p for p in group["params"] if p.requires_grad),
                        key=lambda p: -p.numel()):            # stable: ties in given order
            r = min(range(self.world_size), key=lambda k: (self._load[k], k))
            self.owner[id(p)] = r
            self._load[r] += p.numel()
        if self.local is not None:
            self.local.add_param_group(self._local_group(group))

    def _local_group(self, group: dict) -> dict:
        return {**group, "params": [p for p in group["params"] if self.owner.get(id(p)) == self.rank]}

    def _lay_out_flat(self) -> None:
        """The flat buffer the parameters view, this rank's `shard`, and the `master` the local
        optimizer steps: the shard itself, or its host copy under offload."""
        group = self.param_groups[0]
        names = group.get("param_names") or [str(i) for i in range(len(group["params"]))]
        named = [(n, p) for n, p in zip(names, group["params"]) if p.requires_grad]
        if len({p.dtype for _, p in named}) > 1:
            raise ValueError(f"{WHO}: partition='flat' needs one dtype for all the parameters "
                             "(they share one flat buffer)")
        self.layout = FlatParams(named, self.world_size)
        device = named[0][1].device if named else torch.device("cpu")
        self.flat = self.layout.flatten((p.detach() for _, p in named), device=device)
        self.layout.bind(self.flat)
        self.shard = self.layout.shard(self.flat, self.rank)
        if self.offload:
            pin = self.shard.device.type == "cuda"  # pinned host memory: faster, async copies
            host = dict(dtype=self.shard.dtype, device="cpu", pin_memory=pin)
            self.master = nn.Parameter(torch.empty(self.shard.shape, **host))
            self.master.grad = torch.zeros(self.shard.shape, **host)
            self.master.data.copy_(self.shard)
        else:
            # A Parameter made from a view shares its storage: the update lands in the flat buffer.
            self.master = nn.Parameter(self.shard)

    def all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.partition == "flat":
            self.step_shard(self._gradient_shard())
            if self.world_size > 1:      # in place: this rank's shard is already where it belongs
                dist.all_gather_into_tensor(self.flat, self.shard, group=self.group)
            return loss
        self._pass_settings()
        self.local.step()
        for p in self.all_params():              # the same order on every rank
            if id(p) in self.owner and self.world_size > 1:
                src = dist.get_global_rank(self.group, self.owner[id(p)])
                dist.broadcast(p.data, src=src, group=self.group)
        return loss

    def _gradient_shard(self) -> torch.Tensor:
        """This rank's range of the parameters' (averaged) gradients; a missing one is zero."""
        grads = {s.name: p.grad for s, p in zip(self.layout.slots, self.layout.params)}
        zero = self.flat.new_zeros
        return self.layout.filled_shard(
            lambda s: grads[s.name] if grads[s.name] is not None else zero(s.shape),
            self.rank, device=self.flat.device)

    @torch.no_grad()
    def step_shard(self, grad_shard: torch.Tensor) -> None:
        """flat: the local optimizer steps this rank's shard (the caller all-gathers it)."""
        self._pass_settings()
        if self.offload:
            self.master.grad.copy_(grad_shard)            # device -> host
        else:
            self.master.grad = grad_shard
        self.local.step()
        if self.offload:
            self.shard.copy_(self.master)                 # host -> device
        else:
            self.master.grad = None                       # the caller's: not held past the step

    def _pass_settings(self) -> None:
        # hyper-parameters a scheduler changed in this object's groups reach the local optimizer
        for mine, local in zip(self.param_groups, self.local.param_groups):
            local.update(settings_of(mine))

    def state_dict(self) -> dict:
        """The whole state on every rank, as a plain optimizer's (collective; the lab's code)."""
        return _consolidated().save(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (a `state_dict()` at any world size, or a plain optimizer's)."""
        _consolidated().load(self, state_dict)


def settings_of(group: dict) -> dict:
    """A parameter group's hyper-parameters: all but its parameters and their names."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _consolidated():
    """The lab's consolidated state dict, registered under the entry-point group
    refimpl.sharded_state (refimpl/lab/checkpoint/sharded_optimizer_state.py)."""
    found = plugins("refimpl.sharded_state")
    if not found:
        raise RuntimeError("a sharded optimizer's whole state_dict is refimpl.lab's: install the "
                           "package (pip install -e .) so its entry points are registered")
    return found[0]
