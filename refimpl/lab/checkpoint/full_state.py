"""Any strategy's full state dict: the reference's names and shapes, on the CPU, on every rank."""
from __future__ import annotations

import torch

from refimpl.lab.checkpoint.gather import gather_full_state_dict
from refimpl.lab.twins.base import TorchTwin
from refimpl.parallel.fsdp.zero3 import FullySharded


def full_state_dict(strategy) -> dict[str, torch.Tensor]:
    """The reference model's full state dict, gathered from `strategy`'s rank (collective: every
    rank calls it). A PyTorch twin gathers its own (DTensors, its own parallel plan)."""
    if isinstance(strategy, TorchTwin):
        return strategy.full_state_dict()
    return gather_full_state_dict(local_state(strategy), strategy.model, strategy.mesh)


def local_state(strategy) -> dict[str, torch.Tensor]:
    """This rank's state dict, each ZeRO-3/FSDP unit made whole over its data-parallel group first
    (what is left to gather is the model-parallel axes')."""
    state = strategy.model.state_dict()
    if not isinstance(strategy, FullySharded):
        return state
    whole: dict[str, torch.Tensor] = {}
    for unit in strategy.units:
        whole.update(unit.full_state_dict())
    # and the buffers, replicated (a MoE layer's expert_bias): the state dict minus the units'
    whole.update({n: t for n, t in state.items() if n not in whole})
    return whole
