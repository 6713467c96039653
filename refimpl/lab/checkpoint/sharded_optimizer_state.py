"""ShardedOptimizer's state dict (refimpl.parallel.zero; entry-point group "refimpl.sharded_state"),
consolidated: the whole optimizer's state on every rank, under the indices a plain optimizer over
the same parameters uses, so that it loads into a plain optimizer or into a ShardedOptimizer over
another number of ranks. Saving and loading are both
collectives: every rank calls them.

flat partition: each per-element state (m, v) all-gathered and cut back into the parameters'
shapes; loading reads back only this rank's range of each, one parameter at a time.
"""
from __future__ import annotations

import torch

from refimpl.lab.instrument.state_bytes import per_element
from refimpl.parallel.zero.sharded_optimizer import settings_of
from refimpl.seam import dist


def gathered(layout, shard: torch.Tensor, group) -> torch.Tensor:
    """A new whole flat buffer of `layout` (a FlatParams): every rank's `shard` all-gathered over
    `group` (None: this rank holds the only shard, which is copied)."""
    whole = layout.empty(shard.dtype, shard.device)
    if group is None:
        whole.copy_(shard)
    else:
        dist.all_gather_into_tensor(whole, shard.contiguous(), group=group)
    return whole


def host_copy(value):
    """A tensor copied to the host (each parameter its own: an optimizer steps a count in place)."""
    return value.to("cpu", copy=True) if torch.is_tensor(value) else value


def consolidated_state(opt) -> dict:
    """`opt.state_dict()`: every rank's part of the state, on every rank."""
    index = {id(p): i for i, p in enumerate(opt.all_params())}
    state = _flat_state(opt, index) if opt.partition == "flat" else _tensor_state(opt, index)
    groups, start = [], 0
    for g in opt.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _tensor_state(opt, index: dict[int, int]) -> dict:
    mine = {index[id(p)]: {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
            for p, s in opt.local.state.items()}
    parts = [mine]
    if opt.world_size > 1:
        parts = [None] * opt.world_size
        dist.all_gather_object(parts, mine, group=opt.group)
    return {i: s for part in parts for i, s in part.items()}


def _flat_state(opt, index: dict[int, int]) -> dict:
    """Per-element states gathered and cut into the parameters; the rest (the step count) the
    same for every parameter."""
    local = opt.local.state.get(opt.master, {})
    if not local:
        return {}
    group = opt.group if opt.world_size > 1 else None
    # under offload the state is on the host: gathered on the buffer's device
    cut = {k: opt.layout.views(gathered(opt.layout, v.to(opt.flat.device), group))
           for k, v in local.items() if per_element(v)}
    return {index[id(p)]: {k: host_copy(cut[k][j] if k in cut else v) for k, v in local.items()}
            for j, p in enumerate(opt.layout.params)}


def load_consolidated(opt, state_dict: dict) -> None:
    """`opt.load_state_dict(state_dict)`: this rank's part of a whole state."""
    params = opt.all_params()
    saved = state_dict["param_groups"]
    if [len(g["params"]) for g in saved] != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError("ShardedOptimizer.load_state_dict: the saved parameter groups do not "
                         "match this optimizer's")
    if opt.partition == "flat":
        _load_flat(opt, state_dict, params)
        return
    local_state, local_groups, n = {}, [], 0
    for mine, g in zip(opt.param_groups, saved):
        mine.update({k: v for k, v in g.items() if k != "params"})
        ids = []
        for i in g["params"]:
            if opt.owner.get(id(params[i])) == opt.rank:
                if i in state_dict["state"]:
                    local_state[n] = state_dict["state"][i]
                ids.append(n)
                n += 1
        local_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
    opt.local.load_state_dict({"state": local_state, "param_groups": local_groups})


def _load_flat(opt, state_dict: dict, params: list[torch.Tensor]) -> None:
    """This rank's shard of each per-element state, from the parameters' whole ones reaching into
    it; a parameter without a state (a plain optimizer that never had its gradient) starts at 0."""
    (g,) = state_dict["param_groups"]
    opt.param_groups[0].update(settings_of(g))
    of = {id(params[i]): state_dict["state"].get(i, {}) for i in g["params"]}
    states = {s.name: of[id(p)] for s, p in zip(opt.layout.slots, opt.layout.params)}
    shard = {}
    if any(states.values()):
        elementwise = {k for s in states.values() for k, v in s.items() if per_element(v)}
        shard = {k: host_copy(v) for k, v in next(s for s in states.values() if s).items()
                 if k not in elementwise}
        for k in elementwise:
            shard[k] = opt.layout.filled_shard(
                lambda s, k=k: states[s.name].get(k, torch.zeros(s.shape)), opt.rank,
                dtype=opt.master.dtype, device=opt.master.device)
    opt.local.load_state_dict({"state": {0: shard} if shard else {},
                               "param_groups": [{**settings_of(g), "params": [0]}]})


class ConsolidatedState:
    """What ShardedOptimizer.state_dict and load_state_dict call (entry point refimpl.sharded_state)."""
    save = staticmethod(consolidated_state)
    load = staticmethod(load_consolidated)
