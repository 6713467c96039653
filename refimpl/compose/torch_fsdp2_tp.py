"""`torch-fsdp2-tp`: PyTorch's composed twin of dp x tp -- DTensor tensor parallelism over the tp
dim and FSDP2 over the dp dim of one 2-D DeviceMesh, in torchtitan's order (parallelize_module
first, then activation checkpointing, then fully_shard bottom-up: each block, the embedding, the
root). Our side of the comparison is any DP flavour with `--tp`, e.g. `--strategy fsdp --tp 2`.

    python -m refimpl train --strategy torch-fsdp2-tp --nproc 4 --tp 2      # dp 2 x tp 2

Each parameter ends as a DTensor on the 2-D mesh: Shard on the tp dim where the plan cuts it
(Replicate otherwise), and Shard(0) on the dp dim from fully_shard -- FSDP2 shards the local tp
slice further, so one rank holds 1/(dp·tp) of a matrix, as our `fsdp --tp` does. The loss is the
vocabulary-parallel cross-entropy inside `loss_parallel()`; FSDP2 divides the reduced gradients by
dp (so the loss is not scaled by 1/W: `scales_loss_by_world = False`).

The 2-D DeviceMesh is built from the mesh's own process groups (`DeviceMesh.from_group` with the
dp and tp groups and the global ranks of this replica's dp x tp block): no group is made on the
default one.
"""
from __future__ import annotations

import torch

from refimpl.config import TrainConfig
from refimpl.mesh import LayoutError
from refimpl.model import GPT
from refimpl.model.activation_checkpointing import checkpoint_blocks
from refimpl.parallel.tp.torch_plan import torch_parallelize_tp
from refimpl.parallel.tp.torch_tp import TorchTensorParallel
from refimpl.strategy import make_optimizer


def dp_tp_device_mesh(mesh, device_type: str):
    """This rank's 2-D ("dp", "tp") DeviceMesh, from the refimpl mesh's dp and tp groups. tp is
    the grid's innermost axis (stride 1), so the rank at (i, j) is dp_ranks[i] - my_tp + j."""
    from torch.distributed.device_mesh import DeviceMesh

    me = mesh.index("tp")
    grid = torch.tensor([[r - me + j for j in range(mesh.size("tp"))] for r in mesh.ranks("dp")])
    return DeviceMesh.from_group([mesh.group("dp"), mesh.group("tp")], device_type, mesh=grid,
                                 mesh_dim_names=("dp", "tp"))


class TorchFSDP2TP(TorchTensorParallel):
    name = "torch-fsdp2-tp"
    whole_world_axis = None
    scales_loss_by_world = False

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super(TorchTensorParallel, cls).validate(cfg)
        if cfg.tp < 2 or cfg.pp > 1 or cfg.cp > 1 or cfg.nproc // (cfg.tp * cfg.replicas) < 2:
            raise LayoutError("strategy 'torch-fsdp2-tp' is dp x tp: --tp >= 2, dp = nproc / tp "
                              ">= 2, no --pp or --cp")
        if cfg.model.tie_embeddings:
            raise LayoutError("strategy 'torch-fsdp2-tp' needs untied embeddings")

    def setup(self, model: GPT) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        ctx = self.ctx
        self.model = model.to(ctx.device)
        mesh2d = dp_tp_device_mesh(self.mesh, ctx.device.type)
        torch_parallelize_tp(self.model, mesh2d["tp"], sequence_parallel=ctx.cfg.sequence_parallel)
        if ctx.cfg.activation_checkpointing:
            checkpoint_blocks(self.model)
        kw = {"mesh": mesh2d["dp"]}
        if ctx.cfg.mixed_precision == "bf16":   # as torch-fsdp2: bf16 compute, fp32 reduction
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        for block in self.model.blocks:
            fully_shard(block, **kw)
        fully_shard(self.model.embed, **kw)
        fully_shard(self.model, **kw)
        self.optimizer = make_optimizer(self.model.parameters(), ctx.cfg)
        # The step runner's loop under loss_parallel (TorchTensorParallel.micro_step); its mean
        # over the dp ranks' rows is the loop's global_mean_loss.
        self.run_with_replicated_loss()
