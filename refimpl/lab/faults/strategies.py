"""Each fault as the class a faulty run uses in its strategy's place (refimpl.lab.faults.variant).

Three break one mechanism, and subclass it: its gradient sync differs. The others break what any
strategy runs, and are mixed into the run's own class: a mutated loss or transform (through
`Strategy.transform`, which hands the step its rank model), pipeline links that receive out of
order, a step that loses its rank. None of them is a branch in the core.
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.nn as nn

from refimpl.lab.faults.lost_rank import lose_this_rank
from refimpl.lab.pipeline.speedups import PostedLinks
from refimpl.model import lm_loss
from refimpl.model.rmsnorm import RMSNorm
from refimpl.parallel.dp.naive import NaiveDataParallel
from refimpl.parallel.pp.order import incoming
from refimpl.parallel.pp.runner import run_schedule
from refimpl.parallel.pp.schedules import Action
from refimpl.parallel.tp.mappings import group_size
from refimpl.parallel.tp.vocab import vocab_parallel_cross_entropy
from refimpl.parallel.zero.stages import Zero1
from refimpl.placement import data_parallel_axis
from refimpl.rank_model import RankModel
from refimpl.seam import dist
from refimpl.strategy import Strategy

# --- a mechanism whose sync differs -------------------------------------------------------------


class SkipGradSync(NaiveDataParallel):
    """skip-grad-sync: dp-naive's all-reduce leaves the last block out; its replicas each keep
    their own gradients and step apart."""

    def sync_gradients(self) -> None:
        last = f"blocks.{self.ctx.cfg.model.n_layers - 1}."
        for name, p in self.model.named_parameters():
            group = self.mesh.group(data_parallel_axis(p))
            if group is not None and not name.startswith(last):
                dist.all_reduce(p.grad, group=group)


class ExpertGradOverDp(NaiveDataParallel):
    """expert-grad-over-dp: every gradient summed over dp x cp, an expert's too: with the other
    ranks' different experts instead of over edp, the ranks holding the same one."""

    def sync_gradients(self) -> None:
        group = self.mesh.group("dp_cp")
        for p in self.model.parameters():
            if group is not None:
                dist.all_reduce(p.grad, group=group)


class Zero1Unsynced(Zero1):
    """zero1-unsynced: the textbook path (no buckets), and no reduce-scatter: each rank steps its
    shard with its own gradient (grad_shard is a view of its full gradient buffer)."""

    def option(self, key: str):
        return False if key == "overlap" else super().option(key)

    def sync_gradients(self) -> None:
        pass


SUBCLASSES = {"skip-grad-sync": SkipGradSync, "expert-grad-over-dp": ExpertGradOverDp,
              "zero1-unsynced": Zero1Unsynced}

# --- what any strategy runs, mutated ------------------------------------------------------------


class VocabUnmasked:
    """vocab-unmasked: tp's cross-entropy told the vocabulary is the padded width, so the padded
    columns' logits join the softmax."""

    def transform(self, reference: nn.Module, transforms) -> RankModel:
        rank_model = super().transform(reference, transforms)
        head = next((m for name, m in rank_model.module.named_modules()
                     if name.rpartition(".")[2] == "lm_head"), None)
        if head is None:        # a pipeline stage without the head computes no loss
            return rank_model
        return replace(rank_model, loss_fn=functools.partial(_unmasked, head.group, head.out_start))


def _unmasked(group, start: int, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    padded = logits.shape[-1] * group_size(group)
    return vocab_parallel_cross_entropy(logits, targets, group, start, padded).mean()


class SpNormUnsummed:
    """sp-norm-unsummed: tensor parallelism's transform without the sum over tp of the norms'
    gradients (under SP each rank's covers its own tokens): the hooks it put on them go."""

    def transform(self, reference: nn.Module, transforms) -> RankModel:
        rank_model = super().transform(reference, transforms)
        for module in rank_model.module.modules():
            if isinstance(module, (nn.LayerNorm, RMSNorm)):
                for p in module.parameters():
                    if p._backward_hooks:     # torch's dict of the tensor's gradient hooks
                        p._backward_hooks.clear()
        return rank_model


class LossScaledTwice:
    """pp-loss-scaled-twice: the loss's value as it is, its gradient that of loss / m: the
    pipeline's 1/m applied a second time, invisible in the loss it reports."""

    def transform(self, reference: nn.Module, transforms) -> RankModel:
        rank_model = super().transform(reference, transforms)
        m = self.ctx.cfg.micro_batches
        return replace(rank_model, loss_fn=functools.partial(_scaled_twice, rank_model.loss_fn, m))


def _scaled_twice(loss_fn, m: int, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(logits, targets)
    again = loss / m
    return again + (loss - again).detach()


class P2pMisordered:
    """p2p-misordered: the pipeline run with `MisorderedLinks` in place of its links."""

    def transform(self, reference: nn.Module, transforms) -> RankModel:
        rank_model = super().transform(reference, transforms)
        return rank_model.with_pipeline_run(functools.partial(_misordered_run, rank_model.module))


def _misordered_run(stage, micro, *, divisor: int = 1, autocast=nullcontext, loss_fn=lm_loss):
    """refimpl.parallel.pp.runner.pipeline_forward_backward, on MisorderedLinks."""
    loss = run_schedule(stage.chunks, stage.table, micro, stage.group, divisor=divisor,
                        autocast=autocast, loss_fn=loss_fn, where=stage.where, links=MisorderedLinks)
    return torch.zeros((), dtype=torch.float64, device=micro[0].inputs.device) if loss is None else loss


class MisorderedLinks(PostedLinks):
    """Stage 0's first backward receives the last micro-batch's gradient, its receive posted
    ahead of the step's order: it waits for a message its peer sends only after messages this
    rank has not sent yet (PyTorch #118369). A hang on gloo (messages paired by tag) and under
    NCCL's rules alike (paired in posting order: that receive takes B0's gradient, the later
    ones the next micro-batch's, and the wait shows one backward later)."""

    def receive(self, a: Action) -> torch.Tensor:
        if self.rank == 0 and a.kind == "B" and a.micro_batch == 0:
            a = replace(a, micro_batch=self.m - 1)
            src, message = incoming(a, self.rank, self.p, self.pieces, self.where)
            if (False, src, message) not in self.done:
                self.post((False, src, message))          # ahead of every earlier operation
        return super().receive(a)


class RankDies:
    """rank-dies: rank 1 is lost at the start of its second step (lost_rank.py)."""

    steps_started = 0

    def train_step(self, batch):
        if self.steps_started == 1 and self.ctx.rank == 1:
            lose_this_rank(self.ctx.rank, self.ctx.world_size)
        self.steps_started += 1
        return super().train_step(batch)


MIXINS = {"vocab-unmasked": VocabUnmasked, "sp-norm-unsummed": SpNormUnsummed,
          "pp-loss-scaled-twice": LossScaledTwice, "p2p-misordered": P2pMisordered,
          "rank-dies": RankDies}


@functools.cache
def faulty_class(name: str, strategy_class: type[Strategy]) -> type[Strategy]:
    """The class a run with fault `name` uses in `strategy_class`'s place: the fault's subclass of
    it (refimpl.lab.faults.check made sure it breaks that class), or its mixin over it."""
    if name in SUBCLASSES:
        assert issubclass(SUBCLASSES[name], strategy_class), (name, strategy_class)
        return SUBCLASSES[name]
    mixin = MIXINS[name]
    return type(mixin.__name__ + strategy_class.__name__, (mixin, strategy_class), {})
