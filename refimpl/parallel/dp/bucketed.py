"""`dp`: data parallelism as DDP does it (Li et al. 2020): bucketed all-reduce, overlapped with
backward, one set of buckets per data-parallel group (dp x cp; a MoE's experts over edp)."""
from __future__ import annotations

import weakref

from refimpl.config import Option
from refimpl.model import GPT
from refimpl.parallel.dp.grad_buckets import GradBuckets, MiB, replicated_buckets
from refimpl.parallel.dp.per_group import PerGroup
from refimpl.rank_model import RankModel
from refimpl.strategy import Strategy, make_optimizer


class BucketedDataParallel(Strategy):
    name = "dp"
    options = {"bucket_mb": Option(25.0, float, positive=True)}

    def setup(self, model: GPT) -> None:
        self.model = model
        self.groups = PerGroup(model.named_parameters(), self.buckets_over)
        self.optimizer = make_optimizer(self.model.parameters(), self.ctx.cfg)

    def buckets_over(self, axis: str, named: list) -> GradBuckets:
        """All-reduce buckets over `axis`'s group, summed (each rank's loss was divided by W)."""
        return replicated_buckets(named, self.mesh.group(axis),
                                  float(self.option("bucket_mb")) * MiB)

    def step_model(self, rank_model: RankModel) -> RankModel:
        """Under a pipeline, its whole table runs inside one micro-step of the buckets."""
        if rank_model.pipeline is None:
            return rank_model
        return rank_model.with_pipeline_run(_armed(rank_model.pipeline.run, self.groups.parts,
                                                   self.model.gradient_accumulations()))

    def micro_step(self, is_last: bool):
        return self.groups.micro_step(is_last)      # only the last backward communicates

    def sync_gradients(self) -> None:
        self.groups.finish_gradient_synchronization()


def _armed(run, parts: list[GradBuckets], accumulations: dict[str, int]):
    """`run` inside one synchronised micro-step of every part, parameter `name` expected
    `accumulations[name]` times (the parts held weakly: no cycle through the hooks)."""
    refs = [weakref.ref(buckets) for buckets in parts]
    counts = [[accumulations[slot.name] for slot in buckets.layout.slots] for buckets in parts]

    def armed(*args, **kwargs):
        for ref, each in zip(refs, counts):
            ref().arm(True, each)
        return run(*args, **kwargs)

    return armed
