"""`torch-ddp`: PyTorch's DistributedDataParallel, the twin of `dp`, through the same loop.

DDP implements what refimpl.parallel.dp.bucketed rebuilds (Li et al. 2020): buckets in reverse parameter
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

from torch.nn.parallel import DistributedDataParallel as DDP

from refimpl.config import Option, TrainConfig
from refimpl.lab.instrument.state_bytes import measured_model_state
from refimpl.lab.twins.base import TorchTwin
from refimpl.memory import ModelStateBytes
from refimpl.mesh import LayoutError
from refimpl.model import GPT
from refimpl.strategy import make_optimizer


class TorchTwinDDP(TorchTwin):
    """What the DDP-based twins share: the wrapped model, its `no_sync`, its dp group."""

    options = {"bucket_mb": Option(25.0, float, positive=True)}

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        require_dp_group(cls.name, cfg)

    def wrap(self, model: GPT) -> None:
        ctx = self.ctx
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        self.ddp = DDP(model, device_ids=device_ids,
                       process_group=self.mesh.group("dp_cp"),
                       bucket_cap_mb=float(self.option("bucket_mb")), gradient_as_bucket_view=True)
        self.model = self.ddp.module

    @property
    def forward_model(self):
        return self.ddp

    def micro_step(self, is_last: bool):
        """Communicate on the last micro-step only: `no_sync()` on the others."""
        return contextlib.nullcontext() if is_last else self.ddp.no_sync()


def require_dp_group(name: str, cfg: TrainConfig) -> None:
    """PyTorch's wrappers need a process group of their own for the dp axis; with one dp rank
    beside other axes there is none to give them (ours simply skip the sync)."""
    dims = cfg.dims
    if dims.dp * dims.cp == 1 and cfg.nproc > 1:
        raise LayoutError(f"strategy {name!r} needs at least 2 data-parallel ranks in a grid with "
                          f"other axes (got dp = 1 of --nproc {cfg.nproc})")


class TorchDDP(TorchTwinDDP):
    name = "torch-ddp"
    checkpoints_through_dcp = True

    def setup(self, model: GPT) -> None:
        self.wrap(model)
        self.optimizer = make_optimizer(self.ddp.parameters(), self.ctx.cfg)

    def model_state(self) -> ModelStateBytes:
        return measured_model_state(self.ddp.parameters(), self.optimizer)
