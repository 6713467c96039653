"""`fsdp`: fully sharded data parallel (Zhao et al. 2023, §3): `zero3`'s units and shards, with
the next unit prefetched, the first backward's unit kept, and SHARD_GRAD_OP ("grad_op")."""
from __future__ import annotations

from refimpl.config import Option, TrainConfig
from refimpl.parallel.fsdp.schedule import ShardingPolicy
from refimpl.parallel.fsdp.zero3 import FullySharded

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
