"""The alpha-beta model's all-reduce algorithms side by side: the ring, halving-doubling and the tree
(refimpl.cost.alpha_beta) on a grid of world sizes and message sizes, for notebook 02's chart."""
from __future__ import annotations

from refimpl.cost.alpha_beta import halving_doubling_seconds, ring_seconds, tree_seconds


def all_reduce_rows(world_sizes, sizes_bytes, alpha: float, beta: float,
                    algorithms=("ring", "halving-doubling")) -> list[dict]:
    """Alpha-beta time of each all-reduce algorithm per world size and message size (a plot)."""
    price = {"ring": lambda m, n: ring_seconds("all_reduce", m, n, alpha, beta),
             "halving-doubling": lambda m, n: halving_doubling_seconds(m, n, alpha, beta),
             "tree": lambda m, n: tree_seconds(m, n, alpha, beta)}
    return [{"ranks": n, "size_bytes": m, "algorithm": name, "seconds": price[name](m, n)}
            for n in world_sizes for m in sizes_bytes for name in algorithms]
