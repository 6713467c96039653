"""The step runner: micro-batches through forward and backward (each loss / k, then / W: the
gradients accumulate to the mean), and the global loss. A pipeline runs a schedule's table instead."""
from __future__ import annotations

from typing import Callable, ContextManager

import torch

from refimpl.model import Batch
from refimpl.rank_model import Pipeline
from refimpl.seam import dist, phase


def forward_backward(model: Callable, micro_batches: list[Batch], *, loss_fn: Callable, divisor: int,
                     micro_step: Callable[[bool], ContextManager],
                     autocast: Callable[[], ContextManager]) -> torch.Tensor:
    """Forward and backward over `micro_batches`; returns this rank's mean loss over them (a
    float64 0-d tensor on the model's device: accumulating it costs no host sync)."""
    total = torch.zeros((), dtype=torch.float64, device=micro_batches[0].inputs.device)
    for i, mb in enumerate(micro_batches):
        is_last = i == len(micro_batches) - 1
        with micro_step(is_last):
            with phase("forward"), autocast():
                loss = loss_fn(model(mb.inputs), mb.targets) / len(micro_batches)
            with phase("backward"):
                (loss / divisor if divisor != 1 else loss).backward()
        total += loss.detach().double()
    return total


def global_mean_loss(local: torch.Tensor, mesh, pipeline: Pipeline | None = None) -> torch.Tensor:
    """The mean over the global batch, on every rank."""
    t = local.detach().clone()
    if mesh.size("dp_cp") > 1:
        dist.all_reduce(t, group=mesh.group("dp_cp"))
        t /= mesh.size("dp_cp")
    if mesh.size("pp") == 1:
        return t
    if pipeline.sum_stages:
        dist.all_reduce(t, group=mesh.group("pp"))
    else:
        dist.broadcast(t, src=mesh.global_rank("pp", pipeline.loss_stage), group=mesh.group("pp"))
    return t
