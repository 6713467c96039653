"""PyTorch's twin of refimpl.parallel.pp.runner: the same stages run by `torch.distributed.pipelining`
(`TorchPipeline`), and the strategy `torch-pp-<schedule>` that runs it in the loop.

The comparator, never a dependency. Each rank wraps its chunks (refimpl.parallel.pp.stage, the
same cut as ours) in `PipelineStage`s and hands them to PyTorch's schedule:

  gpipe        ScheduleGPipe
  1f1b         Schedule1F1B              (PyTorch requires micro-batches >= stages)
  interleaved  ScheduleInterleaved1F1B   (one PipelineStage per chunk; virtual stage c*p + r)
  interleaved-zb  ScheduleInterleavedZeroBubble   (the same stages; B/W split by PyTorch's own
                                                   stage_backward_input / stage_backward_weight)
  zbv          ScheduleZBVZeroBubble     (two PipelineStages per rank on the V: stage indices r and
                                          2p-1-r, which PyTorch maps back to ranks with style "v")
  dualpipev    ScheduleDualPipeV         (the same V; its OVERLAP_F_B actions run F then B: PyTorch
                                          leaves the overlap itself to a custom function)

PyTorch splits the batch into micro-batches along dim 0 itself, computes `loss_fn` per micro-batch
and (scale_grads=True) divides the accumulated gradients by m afterwards: the gradient of the mean
loss, as ours, with the 1/m applied after the sum instead of before it (round-off differs).
Under `--mixed-precision bf16` each stage's forward and the loss run under the step runner's
autocast, as ours do, and the backward outside it: bf16 against bf16, not against fp32.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from refimpl.config import TrainConfig
from refimpl.lab.instrument.layer_ranges import around_forward
from refimpl.lab.twins.base import TorchTwin
from refimpl.mesh import LayoutError
from refimpl.model import Batch, lm_loss
from refimpl.parallel.pp.schedules import piece_of, pipeline_schedule, placement
from refimpl.parallel.pp.stage import StageChunk
from refimpl.rank_model import RankModel
from refimpl.seam import phase

TWIN_SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")


def check_torch_layout(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> None:
    """PyTorch's own constraints, as one-line LayoutErrors before launch."""
    if schedule not in TWIN_SCHEDULES:
        raise LayoutError(f"PyTorch's pipelining twin runs {', '.join(TWIN_SCHEDULES)}, not {schedule!r}")
    if schedule == "1f1b" and micro_batches < stages:
        raise LayoutError(f"torch Schedule1F1B needs micro-batches ({micro_batches}) >= stages ({stages})")
    if schedule.startswith("interleaved") and (virtual_stages < 2 and stages > 1 or micro_batches % stages):
        raise LayoutError(f"torch's {schedule} needs --virtual-stages >= 2 and micro-batches "
                          f"({micro_batches}) a multiple of stages ({stages})")
    if schedule == "dualpipev" and micro_batches < 2 * stages:
        raise LayoutError(f"torch ScheduleDualPipeV needs micro-batches ({micro_batches}) >= 2 x stages "
                          f"({2 * stages})")


class TorchPipeline:
    """This rank's PipelineStage(s) and PyTorch's schedule for them."""

    def __init__(self, chunks: list[StageChunk], group, stages: int, schedule: str, micro_batches: int,
                 device: torch.device | str = "cpu", loss_fn=lm_loss):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleDualPipeV,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )

        rank = torch.distributed.get_rank(group)
        pieces = stages * len(chunks)
        where = placement(schedule)
        self.autocast = contextlib.nullcontext     # the step runner's, set by forward_backward
        for chunk in chunks:
            # each F under our runner's autocast (the backward stays outside it, as in refimpl.step);
            # hooks, not a wrapping module: the schedules ask whether the stage's module is FSDP2's
            around_forward(chunk, lambda: self.autocast())
        loss_fn = functools.partial(_loss_under, self, loss_fn)
        self.stages = [PipelineStage(chunk, stage_index=piece_of(rank, c, stages, where), num_stages=pieces,
                                     device=torch.device(device), group=group)
                       for c, chunk in enumerate(chunks)]
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        multi = {"interleaved": ScheduleInterleaved1F1B, "interleaved-zb": ScheduleInterleavedZeroBubble,
                 "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
        if schedule in multi:
            self.schedule = multi[schedule](self.stages, micro_batches, loss_fn=loss_fn)
        else:
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
            self.schedule = cls(self.stages[0], micro_batches, loss_fn=loss_fn)

    def step(self, batch: Batch) -> torch.Tensor | None:
        """Forward and backward of the whole batch; the mean loss on the last stage (a float64 0-d
        tensor on the device: no host read per micro-batch), None elsewhere."""
        args = (batch.inputs,) if self.has_first else ()
        losses: list = []
        kwargs = {"target": batch.targets, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        if not self.has_last:
            return None
        total = torch.zeros((), dtype=torch.float64, device=losses[0].device)
        for loss in losses:           # the same float64 sum, in the same order, as ours
            total += loss.detach().double()
        return total / len(losses)

    def forward_backward(self, micro: list[Batch], *, divisor: int = 1, autocast=None,
                         loss_fn=None) -> torch.Tensor:
        """The step runner's pipeline contract (RankModel.pipeline), run by PyTorch's schedule:
        it cuts the batch into micro-batches itself, so the micro-batches are joined back."""
        whole = Batch(torch.cat([mb.inputs for mb in micro]), torch.cat([mb.targets for mb in micro]))
        self.autocast = autocast or contextlib.nullcontext
        try:
            with phase("forward-backward"):
                loss = self.step(whole)
        finally:
            self.autocast = contextlib.nullcontext
        return torch.zeros((), dtype=torch.float64, device=whole.inputs.device) if loss is None else loss


def _loss_under(pipe: TorchPipeline, loss_fn, output, target):
    """The last stage's loss under the same autocast as its forward (ours: refimpl.parallel.pp.runner)."""
    with pipe.autocast():
        return loss_fn(output, target)


class TorchPipelineParallel(TorchTwin):
    """`torch-pp-<schedule>`: PyTorch's twin, the same stages (our pipeline transform cuts them)
    run by torch.distributed.pipelining's schedules. The whole world is on pp (the registry's
    shorthand), so there is no data-parallel sync; the default placement replicates the stage."""

    on_a_pipeline = True

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        if cfg.model.n_experts:
            raise LayoutError(f"--experts with {cfg.strategy}: PyTorch's schedules run the stages "
                              "themselves and backpropagate the last stage's loss only, so a stage's "
                              "MoE aux loss cannot join it and its expert load is not single's (use pp-*)")
        if cfg.pp != cfg.nproc:
            raise LayoutError(f"--strategy {cfg.strategy} puts the whole world on pp "
                              f"(--pp {cfg.pp} != --nproc {cfg.nproc})")
        check_torch_layout(cfg.pp, cfg.micro_batches, pipeline_schedule(cfg), cfg.virtual_stages)

    def step_model(self, rank_model: RankModel) -> RankModel:
        """Our stages, PyTorch's schedule in place of our runner (the loss stage unchanged)."""
        cfg = self.ctx.cfg
        twin = TorchPipeline(self.model.chunks, self.mesh.group("pp"), cfg.pp,
                             pipeline_schedule(cfg), cfg.micro_batches, self.ctx.device)
        return rank_model.with_pipeline_run(twin.forward_backward)
