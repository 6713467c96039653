"""`zero3`: ZeRO stage 3 (Rajbhandari et al. 2020, §5.3, P_os+g+p, 파라미터까지 분할): parameters,
gradients and optimizer states partitioned, (2 + 2 + K)·Ψ/N bytes per rank; each unit gathered
before its forward and its backward, its gradient reduce-scattered: 3Ψ per step (§7.2.2).
`fsdp` (Zhao et al. 2023, §3): the same units and shards under another policy: the next unit
prefetched, the first backward's unit kept, and SHARD_GRAD_OP ("grad_op")."""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch.nn as nn

from refimpl.config import Option, TrainConfig
from refimpl.mesh import LayoutError
from refimpl.model import GPT
from refimpl.parallel.dp.per_group import PerGroup
from refimpl.parallel.fsdp.schedule import ShardingPolicy, UnitSchedule, assign_params
from refimpl.strategy import Strategy, make_optimizer


def gpt_units(model: GPT) -> list[tuple[str, list]]:
    """(unit name, modules) in forward order: embed, one per block, final_norm + lm_head (those
    a pipeline stage holds)."""
    blocks = (model.blocks.items() if isinstance(model.blocks, nn.ModuleDict)
              else enumerate(model.blocks))
    units = [("embed", [("embed", model.embed)])] if model.embed is not None else []
    units += [(f"blocks.{i}", [(f"blocks.{i}", b)]) for i, b in blocks]
    if model.lm_head is not None:
        units.append(("head", [("final_norm", model.final_norm), ("lm_head", model.lm_head)]))
    return units


class FullySharded(Strategy):
    """Base of `zero3` and `fsdp`; subclasses set `policy(cfg)`, when units move."""

    options = {"offload": Option(False, bool)}

    @classmethod
    def policy(cls, cfg: TrainConfig) -> ShardingPolicy:
        raise NotImplementedError

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        if cfg.model.tie_embeddings:
            raise LayoutError(f"strategy {cls.name!r} does not support tied embeddings (the tied "
                              "weight would belong to two units)")

    def setup(self, model: GPT) -> None:
        self.model = model
        self.groups = PerGroup(model.named_parameters(), self.schedule_over)
        self.units = [u for schedule in self.groups for u in schedule.units]
        self.optimizer = make_optimizer([u.master for u in self.units], self.ctx.cfg)

    def schedule_over(self, axis: str, named: list) -> UnitSchedule:
        """The GPT's units over `axis`'s group (summed: each rank's loss was divided by W)."""
        policy = replace(self.policy(self.ctx.cfg), average=False,
                         offload=bool(self.option("offload")))
        units, root = assign_params(gpt_units(self.model), named)
        return UnitSchedule(units, root, self.mesh.group(axis), policy, self.ctx.device,
                            self.ctx.compute_dtype)

    @contextlib.contextmanager
    def micro_step(self, is_last: bool):
        yield
        self.groups.finish_gradient_synchronization()   # every unit's reduce of this backward

    def sync_gradients(self) -> None:
        # a pipeline's schedule runs its backwards without micro_step
        self.groups.finish_gradient_synchronization()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        for u in self.units:
            u.master.grad.zero_()


class Zero3(FullySharded):
    name = "zero3"

    @classmethod
    def policy(cls, cfg: TrainConfig) -> ShardingPolicy:
        return ShardingPolicy(reshard_after_forward=True, prefetch=False)


SHARDING_MODES = ("full", "grad_op")


class FSDP(FullySharded):
    name = "fsdp"
    options = {**FullySharded.options, "sharding": Option("full", str, choices=SHARDING_MODES),
               "overlap_reduce": Option(False, bool)}

    @classmethod
    def policy(cls, cfg: TrainConfig) -> ShardingPolicy:
        mode = cfg.options.get("sharding", "full")
        return ShardingPolicy(reshard_after_forward=mode == "full", keep_last_unit=True,
                              prefetch=True,
                              async_reduce=bool(cfg.options.get("overlap_reduce", False)))
