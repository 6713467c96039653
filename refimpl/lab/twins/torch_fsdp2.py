"""`torch-fsdp2` (and `torch-fsdp2-gradop`): PyTorch's own FSDP2, the twin of `zero3` / `fsdp`.

`torch.distributed.fsdp.fully_shard` applied bottom-up as torchtitan does -- each transformer
block, then the root -- with the embeddings as a unit of their own, so that the units are exactly
our `fsdp`'s (the root keeps final_norm + lm_head). Each parameter becomes a DTensor sharded on dim 0 (FSDP2 pads each parameter's dim 0
to a multiple of the world size, rather than one flat buffer per unit as FSDP1 and our
FlatParams do); the optimizer then runs on the local shards.

  torch-fsdp2         reshard_after_forward=True  (FULL_SHARD)
  torch-fsdp2-gradop  reshard_after_forward=False (SHARD_GRAD_OP)

--mixed-precision bf16 maps to MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the
policy our own strategies use; --set offload=true to CPUOffloadPolicy (which needs a GPU to mean
anything: on CPU ranks there is nowhere to offload from); the full state dict is then gathered on
the device (`full_tensor_on`).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from refimpl.config import Option, TrainConfig
from refimpl.lab.checkpoint.gather import full_state_items, gather_full_state_dict, placements
from refimpl.lab.instrument.state_bytes import optimizer_state_tensors, tensor_bytes
from refimpl.lab.twins.base import TorchTwin
from refimpl.lab.twins.torch_ddp import require_dp_group
from refimpl.memory import ModelStateBytes
from refimpl.mesh import LayoutError
from refimpl.model import GPT
from refimpl.strategy import make_optimizer


class TorchFSDP2(TorchTwin):
    name = "torch-fsdp2"
    reshard_after_forward = True
    options = {"offload": Option(False, bool)}
    checkpoints_through_dcp = True

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        require_dp_group(cls.name, cfg)
        if cfg.tp > 1 and cfg.sequence_parallel:
            # our tp transform sums those gradients over tp in hooks on the parameters
            # (refimpl.parallel.tp.parallelize); fully_shard replaces the parameters
            raise LayoutError(f"strategy {cfg.strategy!r} with --tp and --sequence-parallel: FSDP2 "
                              "replaces the parameters, and with them the hooks that sum the "
                              "LayerNorm and bias gradients over tp (use torch-fsdp2-tp, or ours)")
        kv_heads = cfg.model.n_kv_heads or cfg.model.n_heads
        if cfg.tp > kv_heads:
            # tp ranks sharing a K/V head sum its gradient in a hook on the parameter
            # (refimpl.parallel.tp.attention._shared_kv), which fully_shard replaces too
            raise LayoutError(f"strategy {cfg.strategy!r} with --tp {cfg.tp} above the {kv_heads} "
                              "key/value heads: FSDP2 replaces the parameters, and with them the "
                              "hooks that sum a shared head's gradient over tp (use ours)")

    def setup(self, model: GPT) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        ctx, cfg = self.ctx, self.ctx.cfg
        # Activation checkpointing before wrapping, the order torchtitan uses.
        self.model = model
        # Where our transforms put each tensor (--tp, --cp shards): fully_shard replaces the
        # parameters by DTensors, which do not keep the record, so it is read now.
        self.placed = placements(model)
        kw = {"reshard_after_forward": self.reshard_after_forward, "mesh": self.device_mesh()}
        if cfg.mixed_precision == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        if cfg.options.get("offload", False) and ctx.device.type == "cuda":
            kw["offload_policy"] = CPUOffloadPolicy()
        fully_shard(self.model.embed, **kw)
        for block in self.model.blocks:
            fully_shard(block, **kw)
        fully_shard(self.model, **kw)
        self.fsdp_modules = [self.model.embed, *self.model.blocks, self.model]
        for module in self.fsdp_modules:   # allocate each unsharded parameter once (see below)
            module.unshard()
            module.reshard()
        self.optimizer = make_optimizer(self.model.parameters(), cfg)

    def device_mesh(self):
        """FSDP2 shards over a DeviceMesh: the mesh's dp x cp group, wrapped as one."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        group = self.mesh.group("dp_cp")
        if group is None:   # one process in all (validate refused dp = 1 beside other axes)
            return init_device_mesh(self.ctx.device.type, (1,))
        return DeviceMesh.from_group(group, self.ctx.device.type)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Each DTensor gathered over dp x cp (FSDP2's shards; buffers such as the MoE layer's
        expert bias are not DTensors), then over the axes our transforms split it on (tp)."""
        return gather_full_state_dict(self._gathered_on_read(), self.model, self.mesh, self.placed)

    def state_items(self):
        return full_state_items(self._gathered_on_read(), self.model, self.mesh, self.placed)

    def _gathered_on_read(self) -> dict:
        return _GatheredOnRead(self.model.state_dict(), device=self.ctx.device)

    def model_state(self) -> ModelStateBytes:
        params = list(self.model.parameters())
        return ModelStateBytes(
            params=tensor_bytes(p.to_local() for p in params),
            grads=tensor_bytes(p.grad.to_local() for p in params if p.grad is not None),
            optimizer=tensor_bytes(t.to_local() for t in optimizer_state_tensors(self.optimizer)))

    def activation_exclusions(self) -> list[torch.Tensor]:
        # FSDP2 gathers into one unsharded tensor per parameter, allocated on the first unshard
        # and then freed / refilled by resizing its storage, as ours does: autograd saves views of
        # them, and they are model state. (Private attributes: FSDP2 offers no public accessor.)
        from torch.distributed.fsdp import fully_shard

        gathered = []
        for module in self.fsdp_modules:
            for group in fully_shard.state(module)._fsdp_param_groups:
                gathered += [fp._unsharded_param for fp in group.fsdp_params
                             if hasattr(fp, "_unsharded_param")]
        return gathered


class _GatheredOnRead(dict):
    """The model's state dict, each DTensor all-gathered when it is read (one at a time)."""

    def __init__(self, state: dict, device: torch.device):
        super().__init__(state)
        self.device = device

    def __getitem__(self, name: str) -> torch.Tensor:
        value = super().__getitem__(name)
        return full_tensor_on(value, self.device) if isinstance(value, DTensor) else value


def full_tensor_on(t: DTensor, device: torch.device) -> torch.Tensor:
    """The whole of the sharded `t`, all-gathered on `device` (the rank's). Under CPUOffloadPolicy
    FSDP2 keeps each local shard in host memory while the mesh is the GPUs', and `full_tensor()`
    would hand the host tensors to the all-gather, which NCCL refuses ("Tensors must be CUDA and
    dense"); FSDP2's own unshard copies the shard to the device first too. Without offload the
    shard is on the device already and this is `full_tensor()`."""
    local = t.to_local()
    if local.device != device:
        t = DTensor.from_local(local.to(device), t.device_mesh, t.placements, run_check=False,
                               shape=t.shape, stride=t.stride())
    return t.full_tensor()


class TorchFSDP2GradOp(TorchFSDP2):
    """SHARD_GRAD_OP: parameters stay unsharded from forward until the end of backward."""
    name = "torch-fsdp2-gradop"
    reshard_after_forward = False
