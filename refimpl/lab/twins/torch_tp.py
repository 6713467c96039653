"""`torch-tp`: PyTorch's DTensor tensor parallelism, the twin of `tp` (plan: torch_plan.py).

The whole world on tp, over the mesh's tp group (`DeviceMesh.from_group`). The cross-entropy runs
inside `loss_parallel()`, which computes it from logits sharded on the vocabulary without gathering
them -- and `backward()` must run inside the same context, since the gradient of the sharded
logits is produced there too: `micro_step` opens it around each micro-batch of the step runner's
loop. The loss is then a replicated DTensor: the loss function hands the loop its local value.
This twin does not compose with our data-parallel strategies (dp must be 1).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from refimpl.config import TrainConfig
from refimpl.lab.instrument.state_bytes import optimizer_state_tensors, tensor_bytes
from refimpl.lab.twins.base import TorchTwin
from refimpl.lab.twins.torch_plan import (
    full_state_dict,
    state_items,
    torch_parallelize_tp,
    torch_plan_problem,
)
from refimpl.memory import ModelStateBytes
from refimpl.mesh import LayoutError
from refimpl.model import GPT, lm_loss
from refimpl.model.activation_checkpointing import checkpoint_blocks
from refimpl.rank_model import RankModel
from refimpl.strategy import make_optimizer


def _local(t):
    """A DTensor's local shard (a plain tensor is its own)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _local_loss(logits, targets):
    return lm_loss(logits, targets).to_local()


def check_plan(cfg: TrainConfig) -> None:
    """What DTensor's tp plan (torch_plan.py) cannot split, refused in one line before launch."""
    if cfg.tp == 1:
        return
    problem = torch_plan_problem(cfg.model, cfg.tp)
    if problem:
        raise LayoutError(f"{cfg.strategy}: {problem}")
    if cfg.model.n_experts:
        raise LayoutError(f"--tp with --experts: {cfg.strategy!r} applies DTensor's tp plan to the "
                          "plain reference, which names no MoE layer (ours split each expert)")


class TorchTensorParallel(TorchTwin):
    name = "torch-tp"
    takes_our_transforms = False   # DTensor parallelize_module on the plain reference
    checkpoints_through_dcp = True

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        check_plan(cfg)
        if cfg.nproc != cfg.tp * cfg.replicas:
            raise LayoutError(f"strategy 'torch-tp' puts every rank on tp (--tp {cfg.tp} with "
                              f"--nproc {cfg.nproc}): it does not compose with dp, pp or cp")

    def setup(self, model: GPT) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        ctx = self.ctx
        self.model = model.to(ctx.device)
        group = self.mesh.group("tp")
        if group is not None:
            tp_mesh = DeviceMesh.from_group(group, ctx.device.type)
            torch_parallelize_tp(self.model, tp_mesh, sequence_parallel=ctx.cfg.sequence_parallel)
        if ctx.cfg.activation_checkpointing:
            checkpoint_blocks(self.model)
        self.optimizer = make_optimizer(self.model.parameters(), ctx.cfg)

    def step_model(self, rank_model: RankModel) -> RankModel:
        """The step runner's loop (refimpl.step) on the DTensor model, its replicated loss read as
        a plain tensor."""
        return RankModel(self.model, loss_fn=_local_loss)

    def micro_step(self, is_last: bool):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()     # around forward and backward: both see the sharded logits

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)

    def state_items(self):
        return state_items(self.model)

    def activation_exclusions(self) -> list[torch.Tensor]:
        return [_local(p) for p in self.model.parameters()]

    def model_state(self) -> ModelStateBytes:
        # DTensor parameters: count each rank's local shards (what this rank's memory holds).
        params = list(self.model.parameters())
        return ModelStateBytes(
            params=tensor_bytes(_local(p) for p in params),
            grads=tensor_bytes(_local(p.grad) for p in params if p.grad is not None),
            optimizer=tensor_bytes(_local(t) for t in optimizer_state_tensors(self.optimizer)))
