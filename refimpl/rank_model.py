"""What the transforms hand the step runner: this rank's model, and how to run it.

The model-parallel transforms (refimpl.compose.transforms) turn the reference GPT into this rank's
share of it. Some of them change how a step must treat the result, and they say so here,
explicitly, instead of patching attributes onto modules:

    module       this rank's model (reference parameter names, its own shards)
    loss_fn      the loss on its logits: lm_loss, or tp's vocabulary-parallel cross-entropy, which
                 reads logits split over the vocabulary without ever gathering them
    shard_batch  cp: a rank's rows -> its chunks of every sequence (ring attention's layout)
    pipeline     pp: runs this rank's row of the schedule table over the micro-batches, in place
                 of the plain accumulation loop (refimpl.parallel.pp.runner)
    aux_loss     the MoE layers' load-balancing loss of the last forward (0 for a dense model;
                 a pipeline's runner adds each chunk's own after that chunk's forward)
    after_step   after the optimizer: DeepSeek-V3's expert-bias nudge (a no-op otherwise)

The strategy (refimpl.strategy) wraps `module` for the data-parallel axis; the step runner reads
the rest.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from refimpl.model import Batch, lm_loss
from refimpl.model.moe import moe_aux_loss, update_expert_bias


@dataclass
class RankModel:
    module: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    shard_batch: Callable[[Batch], Batch] | None = None
    # pipeline(micro_batches, *, divisor, autocast, loss_fn) -> this rank's mean loss (0-d float64)
    pipeline: Callable[..., torch.Tensor] | None = None
    aux_loss: Callable[[], torch.Tensor | float] | None = None    # default: the module's MoE layers'
    after_step: Callable[[], None] | None = None                 # default: their bias step

    def __post_init__(self):
        if self.aux_loss is None:
            self.aux_loss = functools.partial(moe_aux_loss, self.module)
        if self.after_step is None:
            self.after_step = functools.partial(update_expert_bias, self.module)
