"""`fsdp`: FSDP-style fully sharded data parallel, with prefetching (Zhao et al. 2023, §3).

The same units and shards as `zero3` (one unit per transformer block: the "transformer auto-wrap
policy"), plus what makes FSDP fast:

  * forward prefetch: while unit i computes, unit i+1's all-gather is already in flight
    (async_op=True); backward prefetch: while unit i runs its backward, unit i-1's (§3.3);
  * option `overlap_reduce=true`: each reduce-scatter runs in the background of the next unit's
    backward (FSDP's separate reduce-scatter stream). Its price is the gradient in flight: the
    transport's full-size copy of one unit's gradient (gloo reduces a clone, so ours is dropped
    at once; NCCL keeps ours until the collective ends) and the shard it lands in, alive during
    the next unit's backward. Off by default; on these CPU ranks the step peak stays below
    FSDP2's either way (scripts/bench_fsdp.py, notebook 05);
  * the unit whose backward comes first (final_norm + lm_head) keeps its parameters after
    forward, as FSDP2 does for the root module -- it would be gathered again immediately.

Option `sharding` picks PyTorch FSDP's ShardingStrategy (the seed: FULL_SHARD ≈ ZeRO-3,
SHARD_GRAD_OP ≈ ZeRO-2):
  full     FULL_SHARD: free each unit's parameters after its forward, gather again for backward
  grad_op  SHARD_GRAD_OP: keep them from forward to the end of backward -- a full copy of the
           parameters at the peak, like ZeRO-2, but one all-gather per step instead of two

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
