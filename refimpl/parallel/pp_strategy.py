"""`pp-gpipe`, `pp-1f1b`, `pp-interleaved`, `pp-zb`: pipeline parallelism as strategies of the loop,
and PyTorch's twins `torch-pp-gpipe`, `torch-pp-1f1b`, `torch-pp-interleaved`.

    python -m refimpl train --strategy pp-1f1b --nproc 4 --micro-batches 8         # pp = 4
    python -m refimpl train --strategy pp-interleaved --nproc 2 --virtual-stages 2 --micro-batches 4
    python -m refimpl train --strategy pp-zb --nproc 4 --pp 2 --micro-batches 4     # dp 2 x pp 2

Placement: `transforms.model_parallel` cuts the reference model into this rank's stage
(`pp_stage.split_for_pipeline`); the step: `Strategy.train_step` sees a pipeline stage and runs its
row of the schedule table (`pp.pipeline_forward_backward`) instead of the plain micro-batch loop;
the loss lives on the last stage and `global_mean_loss` broadcasts it over pp. With dp > 1 the
stages' gradients are all-reduced over dp after the schedule, as dp-naive does (nothing overlaps).
Gathering: every rank holds only its stage's parameters; the default `full_state_dict` merges them
over the pp group.
"""
from __future__ import annotations

from refimpl.model import GPT
from refimpl.parallel.dp_naive import NaiveDataParallel
from refimpl.strategy import LayoutError, TrainConfig

SCHEDULE_OF = {"pp-gpipe": "gpipe", "pp-1f1b": "1f1b", "pp-interleaved": "interleaved", "pp-zb": "zb-h1",
               "torch-pp-gpipe": "gpipe", "torch-pp-1f1b": "1f1b", "torch-pp-interleaved": "interleaved"}


def pipeline_schedule(cfg: TrainConfig) -> str:
    """The schedule a layout runs: the strategy's own (pp-1f1b, ...), else --schedule, else 1f1b."""
    named = SCHEDULE_OF.get(cfg.strategy)
    chosen = getattr(cfg, "schedule", None)
    if named and chosen and chosen != named:
        raise LayoutError(f"--strategy {cfg.strategy} runs the {named} schedule; drop --schedule {chosen}")
    return named or chosen or "1f1b"


def validate_pipeline(cfg: TrainConfig) -> None:
    """The pipeline's constraints, one line each, before launch (transforms.validate_model_parallel)."""
    from refimpl.parallel.pp_schedules import check_layout
    from refimpl.parallel.pp_stage import partition

    v = getattr(cfg, "virtual_stages", 1)
    if cfg.pp == 1:
        if v != 1 or getattr(cfg, "schedule", None):
            raise LayoutError("--schedule / --virtual-stages need a pipeline: --pp >= 2")
        return
    if cfg.strategy not in SCHEDULE_OF and cfg.strategy != "dp-naive":
        raise LayoutError(f"--pp {cfg.pp} runs with the pp-* strategies or dp-naive, not {cfg.strategy!r}")
    schedule = pipeline_schedule(cfg)
    check_layout(cfg.pp, cfg.micro_batches, schedule, v)
    partition(cfg.model.n_layers, cfg.pp * v)
    if cfg.model.tie_embeddings:
        raise LayoutError("--pp needs untied embeddings: the head and the embedding sit on different stages")
    if schedule == "zb-h1" and cfg.activation_checkpointing:
        raise LayoutError("pp-zb records each layer's input for the deferred W: not with --checkpointing")


class PipelineParallel(NaiveDataParallel):
    """Ours: one runner for any schedule table (refimpl.parallel.pp)."""

    name = "pp"
    min_world_size = 2

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        if cfg.pp < 2:
            raise LayoutError(f"--strategy {cfg.strategy} needs --pp >= 2 pipeline stages "
                              f"(the CLI puts the whole world on pp when --pp is not given)")
    # setup is dp-naive's: model_parallel cuts the stage, the optimizer covers its parameters


class TorchPipelineParallel(PipelineParallel):
    """PyTorch's twin: the same stages, run by torch.distributed.pipelining's schedules."""

    scales_loss_by_world = False

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        from refimpl.parallel.torch_pp import check_torch_layout

        super().validate(cfg)
        if cfg.pp != cfg.nproc:
            raise LayoutError(f"--strategy {cfg.strategy} puts the whole world on pp "
                              f"(--pp {cfg.pp} != --nproc {cfg.nproc})")
        check_torch_layout(cfg.pp, cfg.micro_batches, pipeline_schedule(cfg), getattr(cfg, "virtual_stages", 1))

    def setup(self, model: GPT) -> None:
        from refimpl.parallel.torch_pp import TorchPipeline

        super().setup(model)
        cfg = self.ctx.cfg
        self.model.twin = TorchPipeline(self.model.chunks, self.model.group, cfg.pp,
                                        pipeline_schedule(cfg), cfg.micro_batches, self.ctx.device)


def reference_config(cfg: TrainConfig) -> TrainConfig:
    """The layout `single` must match: same model, batches and micro-batches, no grid. (The
    equivalence helpers set strategy and nproc; the pipeline's own fields are cleared here.)"""
    return cfg.with_(pp=1, replicas=1, schedule=None, virtual_stages=1, nproc=cfg.nproc // cfg.replicas)
