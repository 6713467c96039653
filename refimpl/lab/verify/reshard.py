"""Checkpoint resharding: a full state dict written under one layout, placed by another.

A checkpoint here is always the reference model's full state dict (reference names, full shapes):
every strategy's `full_state_dict` unshards its placement to write it (refimpl.placement),
and every strategy places it from the reference model when it starts (`LabConfig.init_state`:
refimpl.train loads it into the reference before `setup`). So a run saved under zero3 x tp2 resumes
under pp2 x dp2 with no conversion step: the seed's recovery point (체크포인트에서 재시작) across
layouts. AdamW's m, v and step travel the same way, in reference names and full shapes
(refimpl.lab.checkpoint.optim_reshard; `LabConfig.return_optimizer_state` / `init_optimizer_state`):
with them the resumed optimizer continues where it stopped; without them its moments restart from
zero (on every layout alike, so the run still equals `single` resumed from the same weights).
What neither carries: the data order (a resumed run starts again at batch 0) and the RNG state.

    state = train_on_ranks(lab_config(cfg_a).with_(return_state=True))["state_dict"]
    save_checkpoint(state, path)
    placed = placed_state(lab_config(cfg_b).with_(init_state=path))      # == state, tensor for tensor
    resumed = train_on_ranks(lab_config(cfg_b).with_(init_state=path))
"""
from __future__ import annotations

import torch

from refimpl import launch
from refimpl.config import TrainConfig
from refimpl.lab.checkpoint.full_state import full_state_dict
from refimpl.lab.checkpoint.optim_reshard import full_optimizer_state
from refimpl.lab.loop import setup_rank
from refimpl.registry import resolve
from refimpl.train import validate


def save_checkpoint(state: dict[str, torch.Tensor], path) -> None:
    torch.save({k: v.detach().cpu() for k, v in state.items()}, path)


def placed_state_rank(rank: int, world_size: int, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """On one rank: place `cfg.init_state` under `cfg`'s layout, then gather it back, untrained."""

    # exactly as refimpl.train's ranks place it
    _, strategy, _ = setup_rank(rank, world_size, resolve(cfg))
    if cfg.init_optimizer_state is None:
        return full_state_dict(strategy)
    return {"weights": full_state_dict(strategy), "optimizer": full_optimizer_state(strategy)}


def placed_state(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The checkpoint `cfg.init_state` as `cfg`'s layout holds it, gathered back (rank 0's copy);
    with `cfg.init_optimizer_state`, {"weights": ..., "optimizer": full_optimizer_state} instead."""
    layout = validate(cfg)
    return launch.run(placed_state_rank, cfg.nproc, layout.cfg)[0]


def unequal_tensors(placed: dict, weights: dict[str, torch.Tensor], optimizer: dict | None = None) -> list:
    """What `placed_state` gave back and the checkpoint do not agree on, tensor for tensor: a list of
    ("weights", name) and ("exp_avg" | "exp_avg_sq", name) keys, empty when every one is equal."""
    got_w = placed["weights"] if optimizer is not None else placed
    bad = [("weights", k) for k in weights if k not in got_w or not torch.equal(got_w[k], weights[k])]
    if optimizer is None:
        return bad
    got = placed["optimizer"]
    return bad + [(m, k) for m in ("exp_avg", "exp_avg_sq") for k in optimizer[m]
                  if k not in got[m] or not torch.equal(got[m][k], optimizer[m][k])]
