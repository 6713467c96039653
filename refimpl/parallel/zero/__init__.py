"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020): shard the optimizer states, then the gradients.

    shards.py             the step over one group: reduce-scatter, AdamW on the shard, all-gather
    stages.py             zero1 and zero2 in the loop (one mechanism per group: per_group.py)
    sharded_optimizer.py  ShardedOptimizer: partitioned optimizer states for any model
    optimizer_state.py    its state dict, whole on every rank (loads at any world size)
    streaming_reduce.py   zero2's buckets, reduced and freed while backward runs

The flat buffer they shard is refimpl.parallel.dp.flat_param (dp's gradient buckets use it too).
"""
from refimpl.parallel.zero.sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
