"""`zero3`: ZeRO stage 3 -- parameters, gradients and optimizer states all partitioned.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
§5.3 (P_os+g+p): each rank stores 1/N of every model state, so per-rank model-state memory falls
as (2 + 2 + K)·Ψ/N. The price is communication: a unit's parameters are all-gathered before its
forward *and again* before its backward (they were discarded in between), and its gradients are
reduce-scattered when its backward ends -- Ψ + Ψ + Ψ = 3Ψ per step against plain DP's 2Ψ (§7.2.2).

This is the plain version: nothing is prefetched, every gather waits, so the trace shows the
communication exposed. `fsdp` adds the overlap.

    python -m refimpl train --strategy zero3 --nproc 2 --set offload=true
"""
from __future__ import annotations

from refimpl.parallel.fully_sharded import FullySharded, ShardingPolicy
from refimpl.strategy import TrainConfig


class Zero3(FullySharded):
    name = "zero3"

    @classmethod
    def policy(cls, cfg: TrainConfig) -> ShardingPolicy:
        return ShardingPolicy(reshard_after_forward=True, keep_last_unit=False, prefetch=False,
                              async_reduce=False)
