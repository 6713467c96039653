"""`zero1` and `zero2`: ZeRO stages 1 and 2 (Rajbhandari et al. 2020, §5.1-5.2) in the loop,
one mechanism (shards.py) per data-parallel group (PerGroup: a MoE's experts over edp)."""
from __future__ import annotations

import torch.nn as nn

from refimpl.config import Option
from refimpl.parallel.dp.grad_buckets import MiB
from refimpl.parallel.dp.per_group import PerGroup
from refimpl.parallel.zero.sharded_optimizer import ShardedOptimizer
from refimpl.parallel.zero.shards import Zero1Shards, Zero2Shards, ZeroShards
from refimpl.strategy import Strategy, optimizer_settings


class ZeroDataParallel(Strategy):
    """What stages 1 and 2 share; a subclass names its mechanism (`stage`)."""

    options = {"bucket_mb": Option(25.0, float, positive=True), "overlap": Option(True, bool),
               "offload": Option(False, bool)}
    stage: type[ZeroShards]

    def setup(self, model: nn.Module) -> None:
        self.model = model
        self.groups = PerGroup(model.named_parameters(), self.shards_over)
        self.optimizer = self.groups.parts[0].optimizer    # the dense group's

    def shards_over(self, axis: str, named: list) -> ZeroShards:
        """The stage's mechanism over `axis`'s group, on a flat buffer every rank holds whole."""
        group = self.mesh.group(axis)        # None: the axis has one rank
        cls, settings = optimizer_settings(self.ctx.cfg)
        optimizer = ShardedOptimizer(named, cls, group=group, partition="flat",
                                     offload=bool(self.option("offload")), alone=group is None,
                                     **settings)
        return self.stage(optimizer, group, self.bucket_bytes())

    def bucket_bytes(self) -> float | None:
        """Buckets during backward; None (one reduce-scatter after it) under pp, whose schedule
        runs its backwards without micro_step."""
        if not self.option("overlap") or self.mesh.size("pp") > 1:
            return None
        return float(self.option("bucket_mb")) * MiB

    def micro_step(self, is_last: bool):
        return self.groups.micro_step(is_last)

    def sync_gradients(self) -> None:
        self.groups.finish_gradient_synchronization()

    def optimizer_step(self) -> None:
        for part in self.groups:
            part.step()


class Zero1(ZeroDataParallel):
    name = "zero1"
    stage = Zero1Shards


class Zero2(ZeroDataParallel):
    name = "zero2"
    stage = Zero2Shards
