"""`fsdp`: fully sharded data parallel with prefetching (Zhao et al. 2023, §3): `zero3`'s units and
shards, and what makes FSDP fast --

  * prefetch: while unit i computes, unit i+1's all-gather is in flight (in backward, unit i-1's);
  * the unit whose backward comes first (final_norm + lm_head) stays gathered after forward, as
    FSDP2's root module does;
  * `overlap_reduce=true`: each reduce-scatter runs behind the next unit's backward (FSDP's
    reduce-scatter stream), holding the gradient in flight meanwhile.

`sharding` is FSDP's ShardingStrategy: `full` (FULL_SHARD ≈ ZeRO-3) frees a unit after its forward;
`grad_op` (SHARD_GRAD_OP ≈ ZeRO-2) keeps it until its backward, one all-gather per step.

    python -m refimpl train --strategy fsdp --nproc 2 --set sharding=grad_op
"""
from __future__ import annotations

from refimpl.config import Option, TrainConfig
from refimpl.parallel.fsdp.zero3 import FullySharded, ShardingPolicy

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
