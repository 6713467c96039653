"""Pipeline parallelism: one runner for every schedule table (seed 000, sec. 3.4).

    table = schedule_table(p, m, "1f1b")
    loss = run_schedule(chunks, table, batch.micro_batches(m), group)   # the mean loss, last stage

F: receive, forward, send. B: receive, backward, send. W (zero bubble's split): the weights' gradients.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from refimpl.model import Batch, lm_loss
from refimpl.model.moe import moe_aux_loss
from refimpl.parallel.pp.links import Links

# schedule_table and bubble_fraction: DESIGN's contract names them here.
from refimpl.parallel.pp.schedules import Action, bubble_fraction, parse_entry, schedule_table  # noqa: F401
from refimpl.parallel.pp.zero_bubble import WeightGradRecord, record_weight_grads
from refimpl.seam import dist, phase, plugins


def run_schedule(chunks: list, table: list[list[str]], micro: list[Batch], group, *,
                 divisor: int = 1, autocast=nullcontext, loss_fn=lm_loss, where: str = "loop",
                 links=None, backward=None) -> torch.Tensor | None:
    """Run this rank's row of `table` on `micro`, accumulating the gradients of loss / `divisor`;
    returns this rank's part of the mean loss. `where`: the placement; `links`, `backward`: the
    Links and Backward to run on (None: `step_parts()`'s)."""
    rank = 0 if group is None else dist.get_rank(group)
    row = [parse_entry(e) for e in table[rank]]
    links, backward = links or step_parts()[0], backward or step_parts()[1]

    def shape(mb: int):
        rows, seq = micro[mb].inputs.shape
        return (rows, seq // chunks[0].seq_split, chunks[0].d_model)

    step = PipelineStep(chunks, micro, links(group, table, where, len(micro), shape,
                                             next(chunks[0].parameters(), None)),
                        StepLoss(len(micro), divisor, loss_fn, autocast), backward(chunks, row))
    run = {"F": step.forward, "B": step.backward, "W": step.weights}
    for entry in row:
        for a in entry:
            run[a.kind](a)
    step.links.finish()
    return step.loss.total


def step_parts() -> tuple[type, type]:
    """(Links, Backward): the core's, or a "refimpl.pipeline" plug-in's (the same step, faster)."""
    for plugin in plugins("refimpl.pipeline"):
        return plugin()
    return Links, Backward


class PipelineStep:
    """One step of a rank's row: the actions F, B, W and what they keep in between."""

    def __init__(self, chunks, micro: list[Batch], links, loss: StepLoss, split: Backward):
        self.chunks, self.micro, self.links, self.loss, self.split = chunks, micro, links, loss, split
        self.saved = {}         # (micro-batch, chunk) -> (its input, what B backpropagates, kept)

    def name(self, a: Action) -> str:
        return f"pp:{a.text(len(self.chunks) > 1)}"

    def forward(self, a: Action) -> None:
        chunk, mb = self.chunks[a.chunk], self.micro[a.micro_batch]
        x = None if chunk.is_first else self.links.receive(a).requires_grad_()
        with phase("forward"), phase(self.name(a)):
            with self.split.recording(a, chunk) as kept, self.loss.autocast():
                out = chunk(mb.inputs if x is None else x)
            out = self.loss(chunk, out, mb.targets)
        if not chunk.is_last:
            self.links.send(a, out.detach())
        self.saved[(a.micro_batch, a.chunk)] = (x, out, kept)

    def backward(self, a: Action) -> None:
        x, out, kept = self.saved.pop((a.micro_batch, a.chunk))
        grad = None if self.chunks[a.chunk].is_last else self.links.receive(a)
        with phase("backward"), phase(self.name(a)):
            dx = self.split.backward(a, out, grad, x, kept)
        if x is not None:
            self.links.send(a, dx)

    def weights(self, a: Action) -> None:
        with phase("backward"), phase(self.name(a)):
            self.split.weights(a)


class Backward:
    """B and W: one whole backward, or under a table with W's zero bubble's split (Qi et al. 2023):
    B the input gradient only, W the weights' from what F recorded and B stored."""

    def __init__(self, chunks: list, row: list[list[Action]]):
        self.split = any(a.kind == "W" for entry in row for a in entry)
        self.records: dict = {}

    def recording(self, a: Action, chunk):
        if not self.split:
            return nullcontext([])
        self.records[(a.micro_batch, a.chunk)] = record = WeightGradRecord()
        return record_weight_grads(chunk, record)

    def backward(self, a: Action, out, grad, x, kept):
        if not self.split:
            torch.autograd.backward(out, grad)
            return None if x is None else x.grad
        if x is not None:
            return torch.autograd.grad(out, [x], grad)[0]
        for (entry, _), g in zip(kept, torch.autograd.grad(out, [t for _, t in kept], grad)):
            entry[2] = g
        return None

    def weights(self, a: Action) -> None:
        self.records.pop((a.micro_batch, a.chunk)).apply()


class StepLoss:
    """Each micro-batch's loss (the last piece's `loss_fn` plus every piece's MoE aux loss) over m,
    backpropagated as loss / `divisor`; `total`: this rank's part of the mean loss (float64)."""

    def __init__(self, m: int, divisor: int = 1, loss_fn=lm_loss, autocast=nullcontext):
        self.m, self.divisor, self.loss_fn, self.autocast = m, divisor, loss_fn, autocast
        self.total = None

    def add(self, part: torch.Tensor) -> torch.Tensor:
        self.total = part.detach().double() if self.total is None else self.total + part.detach().double()
        return part / self.divisor if self.divisor != 1 else part

    def __call__(self, chunk, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """What the piece backpropagates: its loss on the last piece, else its output."""
        aux = moe_aux_loss(chunk)
        if chunk.is_last:
            with self.autocast():
                return self.add((self.loss_fn(out, targets) + aux) / self.m)
        if not isinstance(aux, torch.Tensor):
            return out
        aux = self.add(aux / self.m)
        return WithLoss.apply(out, aux) if aux.requires_grad else out


class WithLoss(torch.autograd.Function):
    """`out` unchanged, with `loss` backpropagated beside it: a middle piece's MoE aux loss."""

    @staticmethod
    def forward(ctx, out, loss):
        ctx.save_for_backward(loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def pipeline_forward_backward(stage, micro: list[Batch], *, divisor: int = 1,
                              autocast=nullcontext, loss_fn=lm_loss) -> torch.Tensor:
    """The step's pipeline (RankModel.pipeline.run) on a PipelineStageModel; zero where no loss."""
    loss = run_schedule(stage.chunks, stage.table, micro, stage.group, divisor=divisor,
                        autocast=autocast, loss_fn=loss_fn, where=stage.where)
    device = micro[0].inputs.device
    return torch.zeros((), dtype=torch.float64, device=device) if loss is None else loss
