"""What every data-parallel strategy shares: its rows of the global batch and the global mean loss.

Data parallelism (데이터 병렬화, seed §3.1): every rank holds the whole model (or, under ZeRO,
enough of it to compute), takes its own 1/world of the global batch, and the ranks agree on the
gradient by averaging. The strategies in this package differ only in *how* they average and where
the optimizer state lives; the rows each rank takes, the micro-batch loop and the loss they report
are the same, and live here:

  * rank r takes rows [r·B/W, (r+1)·B/W) of the global batch (Batch.shard), split again into
    `cfg.micro_batches` micro-batches for gradient accumulation, each loss scaled by 1/k so the
    accumulated gradient is the mean over the rank's rows;
  * every rank's rows hold the same number of tokens, so the mean of the ranks' mean losses is the
    mean over the global batch: one all-reduce of a scalar gives `single`'s loss on every rank;
  * the gradient average: our strategies scale each rank's loss by 1/W before backward and then
    *sum* the gradients. DDP instead divides every gradient element by W before summing (Li et al.
    2020, §4.2). Same maths; but 1/W applied once, at the top of backward, rounds once, where
    dividing N gradient elements rounds N times, and with W = 3 (1/3 is inexact) that doubles the
    distance to `single`'s weights (measured: ~5e-6 vs ~1.1e-5 after 3 steps). The torch twins
    keep DDP's way (`scales_loss_by_world = False`).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.model import Batch, lm_loss
from refimpl.trace.profiling import comm_span, phase
from refimpl.strategy import LayoutError, Strategy, TrainConfig, require_equal_rows


class DataParallelStrategy(Strategy):
    """Base of dp-naive, dp, zero1, zero2 and their torch twins (see the module docstring).

    `setup` must set `self.model`, this rank's replica (for the torch twins, the wrapped module).
    """

    # option name -> default; `validate` rejects any other key so a typo fails before launch.
    default_options: dict = {}
    # True: backward runs on loss / W and the gradients are summed (see the module docstring).
    scales_loss_by_world: bool = True

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        require_equal_rows(cfg, cfg.nproc)
        unknown = set(cfg.options) - set(cls.default_options)
        if unknown:
            known = ", ".join(sorted(cls.default_options)) or "none"
            raise LayoutError(f"strategy {cls.name!r} has no option(s) {sorted(unknown)}; "
                              f"known: {known}")

    def option(self, key: str):
        return self.ctx.cfg.options.get(key, self.default_options[key])

    def replicate(self, model: nn.Module) -> nn.Module:
        """This rank's full copy of the reference model (built identically on every rank, so no
        broadcast is needed), with activation checkpointing applied when asked for."""
        model = model.to(self.ctx.device)
        if self.ctx.cfg.activation_checkpointing:
            from refimpl.parallel.checkpointing import checkpoint_blocks

            checkpoint_blocks(model)
        return model

    def local_micro_batches(self, batch: Batch) -> list[Batch]:
        rows = batch.shard(self.ctx.rank, self.ctx.world_size).to(self.ctx.device)
        return rows.micro_batches(self.ctx.cfg.micro_batches)

    def forward_backward(self, model: Callable, batch: Batch,
                         micro_step: Callable[[bool], ContextManager] | None = None) -> float:
        """Forward and backward over this rank's micro-batches; returns its mean loss.

        Each micro-step runs inside `micro_step(is_last)` when given: that is where a strategy says
        whether this backward's gradients are communicated -- only the last one's, so the earlier
        ones accumulate locally (gradient accumulation; DDP's `no_sync`)."""
        micro = self.local_micro_batches(batch)
        world = self.ctx.world_size if self.scales_loss_by_world else 1
        local = 0.0
        for i, mb in enumerate(micro):
            is_last = i == len(micro) - 1
            with micro_step(is_last) if micro_step else contextlib.nullcontext():
                with phase("forward"), self.ctx.autocast():
                    loss = lm_loss(model(mb.inputs), mb.targets) / len(micro)
                with phase("backward"):
                    (loss / world).backward()
            local += loss.item()
        return local

    def global_mean_loss(self, local_loss: float) -> float:
        """The mean over ranks of their mean losses = the mean over the global batch."""
        t = torch.tensor([local_loss], dtype=torch.float64, device=self.ctx.device)
        with comm_span("all_reduce", t.nbytes):
            dist.all_reduce(t)
        return float(t.item()) / self.ctx.world_size

    def activation_exclusions(self) -> list[torch.Tensor]:
        # Linear's backward saves weight.t(), a view that is not a Parameter: without this the
        # tracker would count the weights (~5 MB here) as activations.
        return list(self.model.parameters())

    def replicated_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Replicas already hold the full weights: the state dict is local, no communication."""
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
