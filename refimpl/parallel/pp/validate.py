"""A pipeline's layout constraints, checked in the launching process, one line each."""
from __future__ import annotations

from refimpl.config import TrainConfig
from refimpl.mesh import LayoutError
from refimpl.parallel.pp.schedules import check_layout, chunks_per_rank, pipeline_schedule, schedules
from refimpl.parallel.pp.stage import partition


def validate_pipeline(cfg: TrainConfig, strategy) -> None:
    """`strategy`: the class that runs the layout; it must run on a pipeline's stages."""
    v = cfg.virtual_stages
    if cfg.pp == 1:
        if v != 1 or cfg.schedule:
            raise LayoutError("--schedule / --virtual-stages need a pipeline: --pp >= 2")
        return
    if not strategy.on_a_pipeline:
        raise LayoutError(f"--pp {cfg.pp}: strategy {cfg.strategy!r} does not run on pipeline "
                          "stages (ours do: dp-naive, dp, zero1, zero2, zero3, fsdp and the tp, "
                          "ep, pp-* shorthands; PyTorch's: torch-fsdp2-tp, torch-pp-*)")
    schedule = pipeline_schedule(cfg)
    check_layout(cfg.pp, cfg.micro_batches, schedule, v)
    partition(cfg.model.n_layers, cfg.pp * chunks_per_rank(schedule, v))
    if cfg.model.tie_embeddings:
        raise LayoutError("--pp needs untied embeddings: the head and the embedding sit on different stages")
    if schedules()[schedule].split and cfg.activation_checkpointing:
        raise LayoutError(f"{schedule} records each layer's input for the deferred W: not with --checkpointing")
