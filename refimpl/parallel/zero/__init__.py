"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020): shard the optimizer states, then the gradients.

    sharded_optimizer.py  ShardedOptimizer: partitioned optimizer states for any model, whole
                          tensors (any optimizer) or equal shards of a flat buffer (elementwise)
    stages.py         zero1 (optimizer states) and zero2 (+ gradients, reduced as they stream):
                      ShardedOptimizer's flat shards, with the gradients reduce-scattered into them
    torch_zero1.py    torch-zero1: DDP + ZeroRedundancyOptimizer, the twin

The flat buffer they shard is refimpl.parallel.dp.flat_param (dp's gradient buckets use it too).
"""
from refimpl.parallel.zero.sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
