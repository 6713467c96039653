"""`pp-gpipe`, `pp-1f1b`, `pp-interleaved`, `pp-zb`, `pp-interleaved-zb`, `pp-zbv`, `pp-dualpipev`:
pipeline parallelism as strategies of the loop, and PyTorch's twins `torch-pp-gpipe`, `torch-pp-1f1b`,
`torch-pp-interleaved`, `torch-pp-interleaved-zb`, `torch-pp-zbv`, `torch-pp-dualpipev`.

    python -m refimpl train --strategy pp-1f1b --nproc 4 --micro-batches 8         # pp = 4
    python -m refimpl train --strategy pp-interleaved --nproc 2 --virtual-stages 2 --micro-batches 4
    python -m refimpl train --strategy pp-zb --nproc 4 --pp 2 --micro-batches 4     # dp 2 x pp 2
    python -m refimpl train --strategy pp-dualpipev --nproc 2 --micro-batches 4     # the V: 2 chunks each

Placement: `compose.transforms.model_parallel` cuts the reference model into this rank's stage
(`stage.split_for_pipeline`) and hands the step its runner (`RankModel.pipeline`, i.e.
`runner.pipeline_forward_backward`), which runs this rank's row of the schedule table instead of
the plain micro-batch loop;
the loss lives on the stage with the last piece (the last stage; stage 0 on a V) and `global_mean_loss` broadcasts it over pp
(a MoE model: every stage adds its layers' aux losses, and the parts are summed over pp instead). With dp > 1 the
stages' gradients are all-reduced over dp after the schedule, as dp-naive does (nothing overlaps);
under `--strategy dp --pp P` the buckets leave during each stage's cool-down instead
(refimpl.parallel.dp.bucketed).
Gathering: every rank holds only its stage's parameters; the default `full_state_dict` merges them
over the pp group.
"""
from __future__ import annotations

import functools

import torch.nn as nn

from refimpl.config import TrainConfig
from refimpl.mesh import LayoutError
from refimpl.parallel.dp.naive import NaiveDataParallel
from refimpl.parallel.pp.schedules import (
    SCHEDULE_OF,
    SPLIT_SCHEDULES,
    check_layout,
    chunks_per_rank,
    pipeline_schedule,
)
from refimpl.parallel.pp.stage import partition
from refimpl.parallel.pp.torch_pp import TorchPipeline, check_torch_layout

# Data-parallel flavours that run on a pipeline's stages (refimpl.plan.composition), under every
# schedule: `dp` counts each parameter ready at its last backward (or W) of the step, ZeRO-3/FSDP
# reduce-scatter a unit once its W's have delivered every weight gradient (runner's W goes
# through autograd's accumulator: refimpl.parallel.pp.zero_bubble). `ep`: a MoE model's experts
# spread over ep inside each stage's dp group (its sync runs after the schedule, expert gradients
# over edp).
DP_ON_A_PIPELINE = ("dp-naive", "dp", "zero1", "zero2", "zero3", "fsdp", "tp", "ep")
# PyTorch's composed twin runs its own pipelining schedules on dp x tp x pp (refimpl.compose).
TWINS_ON_A_PIPELINE = ("torch-fsdp2-tp",)


def validate_pipeline(cfg: TrainConfig) -> None:
    """The pipeline's constraints, one line each, before launch (compose.transforms)."""

    v = getattr(cfg, "virtual_stages", 1)
    if cfg.pp == 1:
        if v != 1 or getattr(cfg, "schedule", None):
            raise LayoutError("--schedule / --virtual-stages need a pipeline: --pp >= 2")
        return
    if cfg.strategy not in (*SCHEDULE_OF, *DP_ON_A_PIPELINE, *TWINS_ON_A_PIPELINE):
        raise LayoutError(f"--pp {cfg.pp} runs with the pp-* strategies or "
                          f"{', '.join(DP_ON_A_PIPELINE)}, not {cfg.strategy!r}")
    schedule = pipeline_schedule(cfg)
    check_layout(cfg.pp, cfg.micro_batches, schedule, v)
    partition(cfg.model.n_layers, cfg.pp * chunks_per_rank(schedule, v))
    if cfg.model.tie_embeddings:
        raise LayoutError("--pp needs untied embeddings: the head and the embedding sit on different stages")
    if schedule in SPLIT_SCHEDULES and cfg.activation_checkpointing:
        raise LayoutError(f"{schedule} records each layer's input for the deferred W: not with --checkpointing")


class PipelineParallel(NaiveDataParallel):
    """Ours: one runner for any schedule table (refimpl.parallel.pp.runner)."""

    name = "pp"
    min_world_size = 2

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        if cfg.pp < 2:
            raise LayoutError(f"--strategy {cfg.strategy} needs --pp >= 2 pipeline stages "
                              f"(the CLI puts the whole world on pp when --pp is not given)")
    # setup is dp-naive's: the transforms cut the stage, the optimizer covers its parameters


class TorchPipelineParallel(PipelineParallel):
    """PyTorch's twin: the same stages, run by torch.distributed.pipelining's schedules."""

    scales_loss_by_world = False

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        if cfg.pp != cfg.nproc:
            raise LayoutError(f"--strategy {cfg.strategy} puts the whole world on pp "
                              f"(--pp {cfg.pp} != --nproc {cfg.nproc})")
        check_torch_layout(cfg.pp, cfg.micro_batches, pipeline_schedule(cfg), getattr(cfg, "virtual_stages", 1))

    def setup(self, model: nn.Module) -> None:
        super().setup(model)
        cfg = self.ctx.cfg
        twin = TorchPipeline(model.chunks, model.group, cfg.pp, pipeline_schedule(cfg),
                             cfg.micro_batches, self.ctx.device)
        self.rank_model.pipeline = functools.partial(twin.forward_backward)   # PyTorch's schedule, not ours
        self.rank_model.pipeline.loss_stage = model.loss_stage
