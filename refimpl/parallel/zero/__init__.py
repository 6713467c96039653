"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020): shard the optimizer states, then the gradients.

    sharded_adamw.py  AdamW on a shard of the flat buffer
    stages.py         zero1 (optimizer states) and zero2 (+ gradients, reduced as they stream)
    torch_zero1.py    torch-zero1: DDP + ZeroRedundancyOptimizer, the twin
    sharded_optimizer.py  ShardedOptimizer: partitioned states for any optimizer and any model

The flat buffer they shard is refimpl.parallel.dp.flat_param (dp's gradient buckets use it too).
"""
from refimpl.parallel.zero.sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
