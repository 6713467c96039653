"""`torch-tp`: PyTorch's DTensor tensor parallelism, the twin of `tp` (plan: torch_tp_plan.py).

The cross-entropy runs inside `loss_parallel()`, which computes it from logits sharded on the
vocabulary without gathering them -- and `backward()` must run inside the same context, since the
gradient of the sharded logits is produced there too.
"""
from __future__ import annotations

import torch

from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.model import Batch, GPT, lm_loss
from refimpl.parallel.tensor_parallel import TensorParallel
from refimpl.parallel.torch_tp_plan import full_state_dict, torch_parallelize_tp
from refimpl.strategy import make_optimizer
from refimpl.trace.profiling import phase


class TorchTensorParallel(TensorParallel):
    name = "torch-tp"

    def setup(self, model: GPT) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        ctx = self.ctx
        self.mesh = DeviceMesh(ctx.device.type, list(range(ctx.world_size)))
        sp = bool(ctx.cfg.options.get("sequence_parallel", False))
        self.model = torch_parallelize_tp(model.to(ctx.device), self.mesh, sequence_parallel=sp)
        self.optimizer = make_optimizer(self.model.parameters(), ctx.cfg)

    def train_step(self, batch: Batch) -> float:
        from torch.distributed.tensor.parallel import loss_parallel

        micro = batch.to(self.ctx.device).micro_batches(self.ctx.cfg.micro_batches)
        total = 0.0
        for mb in micro:
            with loss_parallel():
                with phase("forward"), self.ctx.autocast():
                    loss = lm_loss(self.model(mb.inputs), mb.targets) / len(micro)
                with phase("backward"):
                    loss.backward()
            total += float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)

    def model_state(self) -> ModelStateBytes:
        # DTensor parameters: count each rank's local shards (what this rank's memory holds).
        local = [getattr(p, "_local_tensor", p) for p in self.model.parameters()]
        grads = [getattr(p.grad, "_local_tensor", p.grad) for p in self.model.parameters()]
        state = measured_model_state(local, None)
        from refimpl.memory import optimizer_state_tensors, tensor_bytes

        opt = tensor_bytes(getattr(t, "_local_tensor", t)
                           for t in optimizer_state_tensors(self.optimizer))
        return ModelStateBytes(params=state.params, grads=tensor_bytes(grads), optimizer=opt)
