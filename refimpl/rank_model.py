"""What the transforms hand the step runner: this rank's model, and how to run it.

The model-parallel transforms (refimpl.compose.transforms) turn the reference GPT into this rank's
share of it. Some of them change how a step must treat the result, and they say so here, in one
frozen object passed explicitly, instead of attributes patched onto modules or functions:

    module       this rank's model (reference parameter names, its own shards)
    loss_fn      the loss on its logits: lm_loss, or tp's vocabulary-parallel cross-entropy, which
                 reads logits split over the vocabulary without ever gathering them
    shard_batch  cp: a rank's rows -> its chunks of every sequence (ring attention's layout)
    pipeline     pp: a `Pipeline` -- how to run this rank's row of the schedule table over the
                 micro-batches (in place of the plain accumulation loop), and how the stages'
                 losses make the step's loss
    aux_loss     the MoE layers' load-balancing loss of the last forward (0 for a dense model;
                 a pipeline's runner adds each chunk's own after that chunk's forward)
    after_step   after the optimizer: DeepSeek-V3's expert-bias nudge (a no-op otherwise)

Frozen, so nothing downstream can change one field and forget another: a strategy that runs the
pipeline inside something of its own (the bucketed `dp` arms its buckets around it; PyTorch's
twins put their own schedule in its place) makes a new object with `with_pipeline_run`, which
keeps every other field as it was.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn as nn

from refimpl.model import Batch, lm_loss
from refimpl.model.moe import moe_aux_loss, update_expert_bias


@dataclass(frozen=True)
class Pipeline:
    """A pipeline stage's step, and where the step's loss comes from.

    `run(micro_batches, *, divisor, autocast, loss_fn)` -> this rank's part of the mean loss
    (0-d float64). The loss is computed on `loss_stage` (the pp index of the stage holding the
    last piece: the last stage, or 0 on a V) and broadcast from it over pp; with MoE layers every
    stage holds a part (its layers' aux losses), and `sum_stages` sums the parts over pp instead
    (refimpl.step.global_mean_loss)."""
    run: Callable[..., torch.Tensor]
    loss_stage: int
    sum_stages: bool = False


@dataclass(frozen=True)
class RankModel:
    module: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    shard_batch: Callable[[Batch], Batch] | None = None
    pipeline: Pipeline | None = None
    aux_loss: Callable[[], torch.Tensor | float] | None = None    # default: the module's MoE layers'
    after_step: Callable[[], None] | None = None                 # default: their bias step

    def __post_init__(self):
        # the defaults read the module, so they are made here (a frozen field is set once, now)
        if self.aux_loss is None:
            object.__setattr__(self, "aux_loss", functools.partial(moe_aux_loss, self.module))
        if self.after_step is None:
            object.__setattr__(self, "after_step", functools.partial(update_expert_bias, self.module))

    def with_pipeline_run(self, run: Callable[..., torch.Tensor]) -> "RankModel":
        """The same rank model with the pipeline's step replaced (its loss stage and how the
        stages' losses combine unchanged)."""
        if self.pipeline is None:
            raise ValueError("with_pipeline_run on a rank model without a pipeline")
        return replace(self, pipeline=replace(self.pipeline, run=run))
