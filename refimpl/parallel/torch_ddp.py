"""`torch-ddp`: PyTorch's DistributedDataParallel, the twin of `dp`, through the same loop.

DDP implements what refimpl.parallel.dp rebuilds (Li et al. 2020): buckets in reverse parameter
order, all-reduce launched from autograd hooks while backward runs, gradients pre-divided by the
world size. Two settings are chosen to make the comparison like for like:

  * bucket_cap_mb = our `bucket_mb`; DDP then uses that cap for its first bucket too (left at its
    default, DDP would make the first bucket 1 MiB);
  * gradient_as_bucket_view=True: .grad tensors are views into DDP's buckets, as ours are, so the
    per-rank gradient memory is one copy (the default keeps a second copy in the buckets).

Gradient accumulation uses `no_sync()` for every micro-step but the last.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.model import Batch, GPT
from refimpl.parallel.data_parallel import DataParallelStrategy
from refimpl.trace.profiling import phase
from refimpl.strategy import make_optimizer


def wrap_ddp(strategy: DataParallelStrategy, model: GPT) -> DDP:
    device_ids = [strategy.ctx.device.index] if strategy.ctx.device.type == "cuda" else None
    return DDP(strategy.replicate(model), device_ids=device_ids,
               bucket_cap_mb=float(strategy.option("bucket_mb")), gradient_as_bucket_view=True)


def ddp_micro_step(ddp: DDP):
    """Communicate on the last micro-step only: `no_sync()` on the others."""
    return lambda is_last: contextlib.nullcontext() if is_last else ddp.no_sync()


class TorchDDP(DataParallelStrategy):
    name = "torch-ddp"
    default_options = {"bucket_mb": 25.0}
    scales_loss_by_world = False         # DDP averages by dividing each gradient by the world size

    def setup(self, model: GPT) -> None:
        self.ddp = wrap_ddp(self, model)
        self.model = self.ddp.module
        self.optimizer = make_optimizer(self.ddp.parameters(), self.ctx.cfg)

    def train_step(self, batch: Batch) -> float:
        local = self.forward_backward(self.ddp, batch, micro_step=ddp_micro_step(self.ddp))
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        return self.global_mean_loss(local)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.replicated_state_dict(self.model)

    def model_state(self) -> ModelStateBytes:
        return measured_model_state(self.ddp.parameters(), self.optimizer)
