"""`single`: the reference. One process, the whole model, the whole global batch.

Every other strategy must reproduce this one's losses and final weights (fp32: rel. error <= 1e-5).
With --micro-batches k it accumulates gradients over k equal micro-batches, scaling each loss by
1/k so the gradient is still the mean over the global batch.
"""
from __future__ import annotations

import torch

from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.model import Batch, GPT, lm_loss
from refimpl.trace.profiling import phase
from refimpl.strategy import Strategy, make_optimizer


class Single(Strategy):
    name = "single"
    max_world_size = 1

    def setup(self, model: GPT) -> None:
        self.model = model.to(self.ctx.device)
        if self.ctx.cfg.activation_checkpointing:
            from refimpl.parallel.checkpointing import checkpoint_blocks

            checkpoint_blocks(self.model)
        self.optimizer = make_optimizer(self.model.parameters(), self.ctx.cfg)

    def train_step(self, batch: Batch) -> float:
        micro = batch.to(self.ctx.device).micro_batches(self.ctx.cfg.micro_batches)
        total = 0.0
        for mb in micro:
            with phase("forward"), self.ctx.autocast():
                loss = lm_loss(self.model(mb.inputs), mb.targets) / len(micro)
            with phase("backward"):
                loss.backward()
            total += loss.item()
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def activation_exclusions(self) -> list[torch.Tensor]:
        # Linear layers save a transposed *view* of their weight: model state, not an activation.
        return list(self.model.parameters())

    def model_state(self) -> ModelStateBytes:
        return measured_model_state(self.model.parameters(), self.optimizer)
