"""What the transforms hand the step runner: this rank's model, and how to run it."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn as nn

from refimpl.model import Batch, lm_loss
from refimpl.model.moe import moe_aux_loss, update_expert_bias


@dataclass(frozen=True)
class Pipeline:
    """A pipeline stage's step, and where the step's loss comes from."""
    run: Callable[..., torch.Tensor]
    loss_stage: int
    sum_stages: bool = False


@dataclass(frozen=True)
class RankModel:
    module: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    shard_batch: Callable[[Batch], Batch] | None = None
    pipeline: Pipeline | None = None

    def aux_loss(self) -> torch.Tensor | float:
        """The module's MoE layers' auxiliary loss of the last forward (0.0 for a dense model)."""
        return moe_aux_loss(self.module)

    def after_step(self) -> None:
        """After the optimizer step: the MoE layers' bias step (balance=bias; else nothing)."""
        update_expert_bias(self.module)

    def with_pipeline_run(self, run: Callable[..., torch.Tensor]) -> "RankModel":
        """The same rank model with the pipeline's step replaced (its loss stage and how the
        stages' losses combine unchanged)."""
        if self.pipeline is None:
            raise ValueError("with_pipeline_run on a rank model without a pipeline")
        return replace(self, pipeline=replace(self.pipeline, run=run))
