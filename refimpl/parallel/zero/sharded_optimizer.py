"""`ShardedOptimizer`: ZeRO stage 1's partitioned optimizer states for any model, in two layouts.

    model = DataParallel(MyNet())                     # or any way of averaging the gradients
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)   # or partition="flat"
    ...backward, model.finish_gradient_synchronization()...
    opt.step()                                        # this rank's partition, then sends it out
    torch.save(opt.state_dict(), path)                # the whole state: loads at any world size

Rajbhandari et al. 2020, §5.1 (P_os): every rank holds the same parameters and the same averaged
gradients, so every rank would compute the same update; instead each parameter element has one
owner, which alone keeps its optimizer state (Adam's m and v: 8 of the 16 bytes per fp32
parameter) and computes its update, then sends the new value to every rank. What it saves is the
optimizer state divided by the world size; what it costs is sending every parameter once per step
(Ψ, the all-gather half of an all-reduce). `partition` says how the owners are chosen:

  "tensors" (default)  whole parameters, greedily by size: largest first, each to the rank holding
      the fewest elements so far (PyTorch's ZeroRedundancyOptimizer does the same); each owner
      broadcasts its updated tensors. Any optimizer works, one that reads a whole tensor (a norm,
      a matrix preconditioner) too, and any parameter groups; but a rank's share is only roughly
      1/N (no share is smaller than the largest tensor), close when tensors are small against the
      model.
  "flat"  the parameters laid end to end in one flat buffer (refimpl.parallel.dp.flat_param) that
      they become views of, padded to N equal shards of exactly ceil(Ψ/N) elements. Each rank runs
      `optimizer_cls` over one parameter, its shard (a view: the update lands in the buffer), and
      one all-gather of the buffer hands every rank the whole update. Equal shards are what the
      collectives want, so the gradients can be reduce-scattered straight into the shards instead
      of all-reduced (the zero1 and zero2 strategies do: refimpl.parallel.zero.stages). The price:
      an elementwise optimizer only (SGD, Adam, AdamW...: element i's update reads only element i
      of the weight, the gradient and the state, so stepping a slice is the arithmetic a plain
      optimizer does for those elements), one parameter group (a shard mixes parameters, so they
      share their hyper-parameters) and one step count. The zero padding stays zero: its gradient
      is zero, and such an update of a zero weight with zero state is zero. A parameter without a
      gradient is stepped with a zero one (a plain optimizer would skip it).
In both, parameters with requires_grad=False are owned by nobody and never sent.

offload=True (flat only) is ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing
Billion-Scale Model Training", §4): the master copy of the shard and its optimizer state live in
host memory and the update runs on the CPU; each step the gradient shard is copied device -> host
and the updated weights host -> device. On a CPU-only machine host and device are the same memory,
so offload changes where the bytes are *accounted* (`host_state`) and adds the two copies; on a GPU
it frees 12 bytes per shard element of GPU memory for fp32 AdamW (16 with the gradient staging) at
the cost of PCIe traffic and a CPU Adam.

`state_dict()` is consolidated: every rank returns the whole state, under the indices a plain
`optimizer_cls` over the same parameters would use (flat: each per-element state all-gathered and
cut back into the parameters' shapes), so it loads into a plain optimizer or into a
ShardedOptimizer at another world size (`load_state_dict` keeps this rank's part). Both are
collectives: every rank calls them.

What the zero1/zero2 strategies need beyond the contract, as DataParallel and FullyShard have it:
`comm` (--collectives refimpl), `values` and `device` (the parameters may be shapes only, each one
written into the flat buffer from refimpl.rank_values on `device`, one at a time: the model is
never held twice), `alone` (a mesh axis of one rank has no group, refimpl.mesh: this rank holds
the only shard), and `step_shard(grad_shard)`, the step from a gradient shard they reduce-scattered
themselves.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.labels import comm_span
from refimpl.memory import ModelStateBytes, measured_model_state, per_element
from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.wrapping import check_devices, group_size, resolve_group

PARTITIONS = ("tensors", "flat")


class ShardedOptimizer(torch.optim.Optimizer):
    """`optimizer_cls(**defaults)` over this rank's partition of `params`, over `group`
    (default: the whole world). See the module docstring."""

    def __init__(self, params, optimizer_cls, *, group=None, partition="tensors", offload=False,
                 comm=dist, values=None, device=None, alone=False, **defaults):
        who = "ShardedOptimizer"
        if partition not in PARTITIONS:
            raise ValueError(f"{who}: partition must be one of {PARTITIONS}, got {partition!r}")
        if offload and partition != "flat":
            raise ValueError(f"{who}: offload=True needs partition='flat' (the host holds one "
                             "flat shard)")
        self.partition, self.offload, self.comm = partition, offload, comm
        self.group = resolve_group(group, who)
        self.rank, self.world_size = ((0, 1) if alone else
                                      (dist.get_rank(self.group), group_size(self.group)))
        self.optimizer_cls = optimizer_cls
        self.owner: dict[int, int] = {}          # tensors: id(parameter) -> its owner's rank
        self._load = [0] * self.world_size       # tensors: elements each rank owns
        self.local: torch.optim.Optimizer | None = None
        super().__init__(params, defaults)       # calls add_param_group for each group
        check_devices([(f"parameter {i}", p) for i, p in enumerate(self._all_params())
                       if values is None or p.device.type != "meta"], self.group, who)
        if partition == "flat":
            self._lay_out_flat(values, device)
            groups = [{**_settings(self.param_groups[0]), "params": [self.master]}]
        else:
            groups = [self._local_group(g) for g in self.param_groups]
        self.local = optimizer_cls(groups, **defaults)
        # every hyper-parameter the class defaults (Adam's betas...) shown here too, so that the
        # state dict carries them and a scheduler finds them
        self.defaults = self.local.defaults
        for g in self.param_groups:
            for k, v in self.defaults.items():
                g.setdefault(k, v)

    def add_param_group(self, param_group: dict) -> None:
        if self.partition == "flat" and self.param_groups:
            raise ValueError("ShardedOptimizer: partition='flat' takes one parameter group (a flat "
                             "shard mixes parameters, so they share their hyper-parameters)")
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

    def _lay_out_flat(self, values, device) -> None:
        """The flat buffer the parameters become views of, this rank's shard of it, and the
        `master` the local optimizer steps: the shard itself, or its host copy under offload."""
        group = self.param_groups[0]
        names = group.get("param_names") or [str(i) for i in range(len(group["params"]))]
        named = [(n, p) for n, p in zip(names, group["params"]) if p.requires_grad]
        if len({p.dtype for _, p in named}) > 1:
            raise ValueError("ShardedOptimizer: partition='flat' needs one dtype for all the "
                             "parameters (they share one flat buffer)")
        self.layout = FlatParams(named, self.world_size)
        if device is None:
            device = named[0][1].device if named else torch.device("cpu")
        made = (p.detach() if values is None else values.local(n, p) for n, p in named)
        self.flat = self.layout.flatten(made, device=device)
        self.layout.bind(self.flat)
        self.shard = self.layout.shard(self.flat, self.rank)
        if self.offload:
            pin = self.shard.device.type == "cuda"  # pinned host memory: faster, async copies
            host = dict(dtype=self.shard.dtype, device="cpu", pin_memory=pin)
            self.master = nn.Parameter(torch.empty(self.shard.shape, **host))
            with torch.no_grad():
                self.master.copy_(self.shard)
            self.master.grad = torch.zeros(self.shard.shape, **host)
        else:
            # A Parameter made from a view shares its storage: the update lands in the flat buffer.
            self.master = nn.Parameter(self.shard)

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _pass_settings(self) -> None:
        # hyper-parameters a scheduler changed in this object's groups reach the local optimizer
        for mine, local in zip(self.param_groups, self.local.param_groups):
            local.update(_settings(mine))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.partition == "flat":
            self.step_shard(self._gradient_shard())
            return loss
        self._pass_settings()
        self.local.step()
        for p in self._all_params():            # the same order on every rank
            if id(p) in self.owner and self.world_size > 1:
                src = dist.get_global_rank(self.group, self.owner[id(p)])
                with comm_span("broadcast", p.nbytes):
                    self.comm.broadcast(p.data, src=src, group=self.group)
        return loss

    def _gradient_shard(self) -> torch.Tensor:
        """This rank's range of the parameters' (averaged) gradients; a missing one is zero."""
        grads = {s.name: p.grad for s, p in zip(self.layout.slots, self.layout.params)}

        def read(slot):
            g = grads[slot.name]
            return g if g is not None else torch.zeros(slot.shape, device=self.flat.device)

        return self.layout.filled_shard(read, self.rank, device=self.flat.device)

    @torch.no_grad()
    def step_shard(self, grad_shard: torch.Tensor) -> None:
        """partition="flat": one step of this rank's shard from its slice of the averaged
        gradient, then the all-gather that hands every rank the whole update."""
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
        if self.world_size > 1:      # in place: this rank's shard is already where it belongs
            with comm_span("all_gather", self.flat.nbytes):
                self.comm.all_gather_into_tensor(self.flat, self.shard, group=self.group)

    def state_dict(self) -> dict:
        """The whole optimizer's state on every rank (collective), indexed like a plain one's."""
        index = {id(p): i for i, p in enumerate(self._all_params())}
        if self.partition == "flat":
            state = self._flat_state(index)
        else:
            mine = {index[id(p)]: {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
                    for p, s in self.local.state.items()}
            parts = [None] * self.world_size
            if self.world_size > 1:
                dist.all_gather_object(parts, mine, group=self.group)
            else:
                parts = [mine]
            state = {i: s for part in parts for i, s in part.items()}
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _flat_state(self, index: dict[int, int]) -> dict:
        """Each per-element state (m, v, a momentum buffer) all-gathered and cut back into the
        parameters' shapes; the rest (the step count) the same for every parameter."""
        local = self.local.state.get(self.master, {})
        if not local:
            return {}
        cut = {k: self.layout.views(self._gathered(v)) for k, v in local.items() if per_element(v)}
        return {index[id(p)]: {k: _host_copy(cut[k][j] if k in cut else v) for k, v in local.items()}
                for j, p in enumerate(self.layout.params)}

    def _gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole flat buffer of one per-element state, from every rank's shard of it."""
        mine = shard.to(self.flat.device)          # under offload, from the host
        if self.world_size == 1:
            return self.layout.gathered(mine, None, self.comm)
        with comm_span("all_gather", self.flat.nbytes):
            return self.layout.gathered(mine, self.group, self.comm)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (from `state_dict()` at any world size, or a plain optimizer's)."""
        params = self._all_params()
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("ShardedOptimizer.load_state_dict: the saved parameter groups do not "
                             "match this optimizer's")
        if self.partition == "flat":
            self._load_flat(state_dict, params)
            return
        local_state, local_groups, n = {}, [], 0
        for mine, g in zip(self.param_groups, saved):
            mine.update({k: v for k, v in g.items() if k != "params"})
            ids = []
            for i in g["params"]:
                if self.owner.get(id(params[i])) == self.rank:
                    if i in state_dict["state"]:
                        local_state[n] = state_dict["state"][i]
                    ids.append(n)
                    n += 1
            local_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        self.local.load_state_dict({"state": local_state, "param_groups": local_groups})

    def _load_flat(self, state_dict: dict, params: list[torch.Tensor]) -> None:
        """This rank's shard of each per-element state, made from the parameters' whole ones
        reaching into it (one at a time: FlatParams.filled_shard); a parameter without a state
        (a plain optimizer that never had its gradient) starts from zeros."""
        (g,) = state_dict["param_groups"]
        self.param_groups[0].update(_settings(g))
        of = {id(params[i]): state_dict["state"].get(i, {}) for i in g["params"]}
        states = {s.name: of[id(p)] for s, p in zip(self.layout.slots, self.layout.params)}
        shard = {}
        if any(states.values()):
            elementwise = {k for s in states.values() for k, v in s.items() if per_element(v)}
            shard = {k: _host_copy(v) for k, v in next(s for s in states.values() if s).items()
                     if k not in elementwise}
            for k in elementwise:
                shard[k] = self.layout.filled_shard(
                    lambda s, k=k: states[s.name].get(k, torch.zeros(s.shape)), self.rank,
                    dtype=self.master.dtype, device=self.master.device)
        self.local.load_state_dict({"state": {0: shard} if shard else {},
                                    "param_groups": [{**_settings(g), "params": [0]}]})

    def host_state(self) -> ModelStateBytes:
        """What offload keeps in host memory; the master copy counts as optimizer state, as in
        the ZeRO paper's K = 12 for fp32 AdamW (master + m + v)."""
        if not self.offload:
            return ModelStateBytes(0, 0, 0)
        held = measured_model_state([self.master], self.local)
        return ModelStateBytes(params=0, grads=held.grads, optimizer=held.params + held.optimizer)


def _settings(group: dict) -> dict:
    """A parameter group's hyper-parameters: all but its parameters and their names."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _host_copy(value):
    """A tensor copied to the host (each parameter its own: an optimizer steps a count in place)."""
    return value.to("cpu", copy=True) if torch.is_tensor(value) else value
