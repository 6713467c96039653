"""`ShardedOptimizer`: ZeRO stage 1's partitioned optimizer states for any optimizer and any model.

    model = DataParallel(MyNet())                     # or any way of averaging the gradients
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    ...backward, model.finish_gradient_synchronization()...
    opt.step()                                        # this rank's partition, then broadcasts
    torch.save(opt.state_dict(), path)                # the whole state: loads at any world size

Rajbhandari et al. 2020, §5.1 (P_os): every rank holds the same parameters and the same averaged
gradients, so every rank would compute the same update; instead each parameter has one owner,
which alone keeps its optimizer state (Adam's m and v: 8 of the 16 bytes per fp32 parameter) and
computes its update, then sends the new value to every rank. What it saves is the optimizer state
divided by the world size; what it costs is one broadcast of every parameter per step (Ψ, the
all-gather half of an all-reduce).

Unlike the `zero1` strategy (refimpl.parallel.zero.stages), which cuts one flat padded buffer into
equal shards -- exactly Ψ/N elements each, but only for an elementwise optimizer such as AdamW --
this class partitions whole parameters, so any optimizer (one that reads a whole tensor: a norm,
a matrix preconditioner) steps each tensor whole. The partition is greedy by size: largest first,
each to the rank holding the fewest elements so far (PyTorch's ZeroRedundancyOptimizer does the
same), so a rank's share is close to 1/N when tensors are small against the model. Parameters with
requires_grad=False are owned by nobody and never sent.

`state_dict()` is consolidated: every rank returns the whole state, under the indices a plain
`optimizer_cls` over the same parameters would use, so it loads into a plain optimizer or into a
ShardedOptimizer at another world size (`load_state_dict` keeps this rank's part). Both are
collectives: every rank calls them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.labels import comm_span
from refimpl.parallel.dp.wrapping import check_devices, group_size, resolve_group


class ShardedOptimizer(torch.optim.Optimizer):
    """`optimizer_cls(**defaults)` over this rank's partition of `params`, over `group`
    (default: the whole world). See the module docstring."""

    def __init__(self, params, optimizer_cls, *, group=None, **defaults):
        who = "ShardedOptimizer"
        self.group = resolve_group(group, who)
        self.rank, self.world_size = dist.get_rank(self.group), group_size(self.group)
        self.optimizer_cls = optimizer_cls
        self.owner: dict[int, int] = {}          # id(parameter) -> its owner's rank in the group
        self._load = [0] * self.world_size       # elements each rank owns
        self.local: torch.optim.Optimizer | None = None
        super().__init__(params, defaults)       # calls add_param_group for each group
        check_devices([(f"parameter {i}", p) for i, p in enumerate(self._all_params())],
                      self.group, who)
        groups = [self._local_group(g) for g in self.param_groups]
        self.local = optimizer_cls(groups, **defaults)
        # every hyper-parameter the class defaults (Adam's betas...) shown here too, so that the
        # state dict carries them and a scheduler finds them
        self.defaults = self.local.defaults
        for g in self.param_groups:
            for k, v in self.defaults.items():
                g.setdefault(k, v)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
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

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # hyper-parameters a scheduler changed in this object's groups reach the local optimizer
        for mine, local in zip(self.param_groups, self.local.param_groups):
            local.update({k: v for k, v in mine.items() if k != "params"})
        self.local.step()
        for p in self._all_params():            # the same order on every rank
            if id(p) in self.owner and self.world_size > 1:
                src = dist.get_global_rank(self.group, self.owner[id(p)])
                with comm_span("broadcast", p.nbytes):
                    dist.broadcast(p.data, src=src, group=self.group)
        return loss

    def state_dict(self) -> dict:
        """The whole optimizer's state on every rank (collective), indexed like a plain one's."""
        index = {id(p): i for i, p in enumerate(self._all_params())}
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

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (from `state_dict()` at any world size, or a plain optimizer's)."""
        params = self._all_params()
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("ShardedOptimizer.load_state_dict: the saved parameter groups do not "
                             "match this optimizer's")
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
