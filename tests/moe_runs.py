"""Multi-rank runs of the MoE model for tests/test_moe.py: expert parallel over every rank, the
non-expert parameters data-parallel over the same ranks, against the one-process model.

One launch per world size runs every case (process start-up dominates on a small machine).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from refimpl import launch
from refimpl.lab.checkpoint.gather import gather_full_state_dict
from refimpl.lab.measure.moe_traffic import all_to_all_bytes, meter_experts
from refimpl.lab.verify.group_mesh import GroupMesh
from refimpl.model import GPTConfig, build_model, lm_loss, synthetic_batch
from refimpl.model.moe import moe_aux_loss, moe_layers, update_expert_bias
from refimpl.parallel.ep.dispatch import parallelize_experts
from refimpl.placement import Owned, placement_of
from refimpl.seam import use_collectives

BASE = GPTConfig(vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4)
CASES = {
    "top2-no-drops": dict(top_k=2, capacity_factor=4.0),
    "top1-tight": dict(top_k=1, capacity_factor=0.5, balance="none"),
    "top2-tight-bias": dict(top_k=2, capacity_factor=0.75, balance="bias", bias_gamma=0.01),
    "expert3-starved": dict(top_k=2, capacity_factor=4.0, balance="bias"),
}
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3


def is_expert_param(p: torch.Tensor) -> bool:
    return isinstance(placement_of(p), Owned)


def case_config(name: str) -> GPTConfig:
    from dataclasses import replace

    return replace(BASE, **CASES[name])


def train_moe(cfg: GPTConfig, rank: int = 0, world: int = 1, group=None, comm=None) -> dict:
    """STEPS AdamW steps; the first step's gradients, every step's loss, keep masks and loads."""
    torch.manual_seed(0)
    model = build_model(cfg, seed=0).double()   # float64: the 1e-9 gate holds on any processor
    if cfg.balance == "bias" and "starved" in _name(cfg):
        for layer in moe_layers(model):       # expert 3 is never chosen: it receives no tokens
            layer.expert_bias[3] = -10.0
    if group is not None:
        meter_experts(parallelize_experts(model, group))
    use_collectives(comm)          # None: torch.distributed's; refimpl.comm: the rebuilt ones
    try:
        return _train(model, cfg, rank, world, group)
    finally:
        use_collectives(None)


def _train(model, cfg: GPTConfig, rank: int, world: int, group) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    out = {"losses": [], "keep": [], "routed": [], "received": [], "dropped": [], "bytes": []}
    for step in range(STEPS):
        batch = synthetic_batch(cfg, GLOBAL_BATCH, SEQ, 0, step).shard(rank, world)
        loss = (lm_loss(model(batch.inputs), batch.targets) + moe_aux_loss(model)) / world
        loss.backward()
        if group is not None:
            for p in model.parameters():
                if not is_expert_param(p):    # experts already got every rank's rows' gradient
                    dist.all_reduce(p.grad, group=group)
            dist.all_reduce(loss := loss.detach().clone(), group=group)
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=False)
        update_expert_bias(model)
        layers = moe_layers(model)
        out["losses"].append(float(loss.detach()))
        out["keep"].append([layer.keep.clone() for layer in layers])
        out["routed"].append([layer.stats.routed.clone() for layer in layers])
        out["received"].append([layer.stats.received.clone() for layer in layers])
        out["dropped"].append([layer.stats.dropped for layer in layers])
        out["bytes"].append(all_to_all_bytes(model))
    out["state"] = gather_full_state_dict(model.state_dict(), model, GroupMesh(ep=group))
    return out


def _name(cfg: GPTConfig) -> str:
    return next(n for n in CASES if case_config(n) == cfg)


def _all_cases_rank(rank: int, world: int, use_refimpl_comm: bool = False) -> dict:
    import refimpl.comm as rcomm
    from refimpl.lab.instrument.labels import CommLog

    group = dist.new_group(list(range(world)))
    results = {name: train_moe(case_config(name), rank, world, group) for name in CASES}
    # The same no-drop case on refimpl.comm's collectives, its sends counted by CommLog.
    with CommLog() as counted:
        results["refimpl-comm"] = train_moe(case_config("top2-no-drops"), rank, world, group,
                                            comm=rcomm)
    results["refimpl-comm"]["counted"] = {"sent": dict(counted.sent)}
    return results


@functools.lru_cache(maxsize=None)
def runs_on(world: int) -> list[dict]:
    return launch.run(_all_cases_rank, world, timeout=600, quiet=True)


@functools.lru_cache(maxsize=None)
def single(name: str) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_moe(case_config(name))
    finally:
        torch.set_num_threads(threads)
