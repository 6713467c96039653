"""`torch-zero1`: DDP + torch.distributed.optim.ZeroRedundancyOptimizer, the twin of `zero1`.

ZeroRedundancyOptimizer partitions the optimizer states (ZeRO stage 1, Rajbhandari et al. 2020,
§5.1) but not as a flat buffer: it assigns whole parameter tensors to ranks, greedily by size, so
per-rank optimizer memory is only roughly 1/world, and after each rank's local AdamW step the
owners broadcast their updated parameters. Gradients are all-reduced by DDP (full gradients on
every rank, as in our `zero1`). AdamW is elementwise, so whichever rank updates a tensor computes
exactly what `single` computes.
"""
from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from refimpl.lab.instrument.state_bytes import measured_model_state
from refimpl.lab.twins.torch_ddp import TorchTwinDDP
from refimpl.memory import ModelStateBytes
from refimpl.model import GPT


class TorchZero1(TorchTwinDDP):
    name = "torch-zero1"

    def setup(self, model: GPT) -> None:
        cfg = self.ctx.cfg
        self.wrap(model)
        self.optimizer = ZeroRedundancyOptimizer(
            self.ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=cfg.lr,
            weight_decay=cfg.weight_decay, foreach=False, process_group=self.mesh.group("dp_cp"))

    def optimizer_step(self) -> None:
        self.optimizer.step()      # local AdamW on this rank's tensors, then broadcasts
        self.optimizer.zero_grad(set_to_none=False)

    def model_state(self) -> ModelStateBytes:
        # .optim is the local optimizer: the states this rank actually holds.
        return measured_model_state(self.ddp.parameters(), self.optimizer.optim)
