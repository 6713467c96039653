"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020): shard the optimizer states, then the gradients."""
from refimpl.parallel.zero.sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
