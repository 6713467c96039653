"""`torch-fsdp2-tp`: PyTorch's composed twin of dp x tp (x pp) -- DTensor tensor parallelism over
the tp dim and FSDP2 over the dp dim of one 2-D DeviceMesh, in torchtitan's order (the pipeline
split first, then parallelize_module, then activation checkpointing, then fully_shard bottom-up:
each block, the embedding, the root), and with --pp PyTorch's own pipeline schedules
(torch.distributed.pipelining, refimpl.lab.twins.torch_pp) over the stages. Our side of the
comparison is any DP flavour with `--tp` (and `--pp`), e.g. `--strategy fsdp --tp 2 --pp 2`.

    python -m refimpl train --strategy torch-fsdp2-tp --nproc 4 --tp 2      # dp 2 x tp 2
    python -m refimpl train --strategy torch-fsdp2-tp --nproc 8 --tp 2 --pp 2 --micro-batches 2

Each parameter ends as a DTensor on the 2-D mesh: Shard on the tp dim where the plan cuts it
(Replicate otherwise), and Shard(0) on the dp dim from fully_shard -- FSDP2 shards the local tp
slice further, so one rank holds 1/(dp·tp) of a matrix, as our `fsdp --tp` does. The loss is the
vocabulary-parallel cross-entropy inside `loss_parallel()`; FSDP2 divides the reduced gradients by
dp (so the loss is not scaled by 1/W: TorchTwin.loss_divisor).

The 2-D DeviceMesh is built from the mesh's own process groups (`DeviceMesh.from_group` with the
dp and tp groups and the global ranks of this replica's dp x tp block): no group is made on the
default one. Under a pipeline each stage has its own dp x tp block (its ranks share the pp index).

With --pp (torchtitan's pipeline_llama + parallelize_llama): each rank cuts the reference into its
pieces (refimpl.parallel.pp.stage.build_chunks, the cut ours uses), turns each piece into DTensor
TP and wraps it in FSDP2, then hands the pieces to `PipelineStage`s and PyTorch's schedule, run
inside `loss_parallel()` (its loss and its backward both see the vocabulary-sharded logits).
PyTorch's stage knows FSDP2: it turns the gradient reduce-scatter off for every micro-batch's
backward, runs it once per piece after the last one (PipelineStage.perform_reduce_grad), then
divides the gradients by the micro-batch count. The split-backward schedules (interleaved-zb, zbv,
dualpipev) are refused: on PyTorch 2.13 with FSDP2 their deferred weight gradients come out wrong
(weights 3-7 % off single after 2 steps on dp2 x tp2 x pp2, in float64), while the same DTensor
stages without FSDP2 (tp2 x pp2, zbv) equal single.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn as nn

from refimpl.config import TrainConfig
from refimpl.lab.checkpoint.gather import merge_stages
from refimpl.lab.twins.torch_plan import full_state_dict, state_items, torch_parallelize_tp
from refimpl.lab.twins.torch_pp import TorchPipeline, check_torch_layout
from refimpl.lab.twins.torch_tp import TorchTensorParallel, check_plan
from refimpl.mesh import LayoutError
from refimpl.model import GPT, lm_loss
from refimpl.model.activation_checkpointing import checkpoint_blocks
from refimpl.parallel.pp.schedules import chunks_per_rank, pipeline_schedule, placement, schedules
from refimpl.parallel.pp.stage import build_chunks
from refimpl.rank_model import Pipeline, RankModel
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
    on_a_pipeline = True

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super(TorchTensorParallel, cls).validate(cfg)
        check_plan(cfg)
        if cfg.tp < 2 or cfg.cp > 1 or cfg.nproc // (cfg.tp * cfg.pp * cfg.replicas) < 2:
            raise LayoutError("strategy 'torch-fsdp2-tp' is dp x tp (x pp): --tp >= 2, "
                              "dp = nproc / (tp x pp) >= 2, no --cp")
        if cfg.model.tie_embeddings:
            raise LayoutError("strategy 'torch-fsdp2-tp' needs untied embeddings")
        if cfg.pp > 1:
            schedule = pipeline_schedule(cfg)
            check_torch_layout(cfg.pp, cfg.micro_batches, schedule, cfg.virtual_stages)
            if schedules()[schedule].split:
                raise LayoutError(f"strategy 'torch-fsdp2-tp' with the {schedule} schedule: PyTorch "
                                  "2.13's split backward (stage_backward_input / _weight) leaves "
                                  "FSDP2's gradients wrong (use gpipe, 1f1b or interleaved)")

    def setup(self, model: GPT) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg
        model = model.to(ctx.device)
        mesh2d = dp_tp_device_mesh(self.mesh, ctx.device.type)
        pp, schedule = self.mesh.size("pp"), pipeline_schedule(cfg)
        # torchtitan's order: the pipeline split first, then each piece parallelized on its own
        pieces = [model] if pp == 1 else build_chunks(
            model, pp, self.mesh.index("pp"), chunks_per_rank(schedule, cfg.virtual_stages),
            where=placement(schedule))
        for piece in pieces:
            torch_parallelize_tp(piece, mesh2d["tp"], sequence_parallel=cfg.sequence_parallel)
            if cfg.activation_checkpointing:
                checkpoint_blocks(piece)
            self._fully_shard(piece, mesh2d["dp"])
        self.model = model if pp == 1 else _Pieces(pieces)
        self.optimizer = make_optimizer(self.model.parameters(), cfg)
        self.pieces = pieces

    def step_model(self, rank_model: RankModel) -> RankModel:
        """The step runner's loop under loss_parallel (TorchTensorParallel.micro_step), its mean
        over the dp ranks' rows the loop's global_mean_loss; with --pp, PyTorch's schedule over
        the pieces, the loss on the stage with the last piece."""
        plain = super().step_model(rank_model)
        pp, cfg = self.mesh.size("pp"), self.ctx.cfg
        if pp == 1:
            return plain
        schedule = pipeline_schedule(cfg)
        twin = TorchPipeline(self.pieces, self.mesh.group("pp"), pp, schedule, cfg.micro_batches,
                             self.ctx.device, loss_fn=_replicated_loss)
        return replace(plain, pipeline=Pipeline(functools.partial(_under_loss_parallel, twin),
                                                loss_stage=0 if placement(schedule) == "v" else pp - 1))

    def _fully_shard(self, piece: nn.Module, dp_mesh) -> None:
        """FSDP2 bottom-up over one piece: each block, the embedding (if here), the piece."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {"mesh": dp_mesh}
        if self.ctx.cfg.mixed_precision == "bf16":   # as torch-fsdp2: bf16 compute, fp32 reduction
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        blocks = piece.blocks.values() if isinstance(piece.blocks, nn.ModuleDict) else piece.blocks
        for block in blocks:
            fully_shard(block, **kw)
        if piece.embed is not None:
            fully_shard(piece.embed, **kw)
        fully_shard(piece, **kw)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        full = full_state_dict(self.model)          # this stage's names, gathered over dp x tp
        return merge_stages(full, self.mesh) if self.mesh.size("pp") > 1 else full

    def state_items(self):
        return state_items(self.model)             # this stage's, gathered over dp x tp


class _Pieces(nn.Module):
    """This rank's pipeline pieces under the reference's parameter names (embed, blocks.<i>,
    final_norm, lm_head): what the optimizer, the memory count and the gather read."""

    def __init__(self, pieces: list[nn.Module]):
        super().__init__()
        self.embed = next((p.embed for p in pieces if p.embed is not None), None)
        self.blocks = nn.ModuleDict({k: b for p in pieces for k, b in p.blocks.items()})
        self.final_norm = next((p.final_norm for p in pieces if p.final_norm is not None), None)
        self.lm_head = next((p.lm_head for p in pieces if p.lm_head is not None), None)


def _replicated_loss(logits, targets):
    """The vocabulary-parallel loss of a micro-batch (a replicated DTensor), as a plain tensor: a
    copy, not to_local()'s view, since the zero-bubble schedules' input backward (PyTorch's
    stage_backward_input) detaches the stage's output in place, which a view refuses."""
    return lm_loss(logits, targets).to_local().clone()


def _under_loss_parallel(twin: TorchPipeline, micro, **kw):
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return twin.forward_backward(micro, **kw)
