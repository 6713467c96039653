"""The alpha-beta model's two all-reduce algorithms side by side: the ring and halving-doubling
(refimpl.cost.alpha_beta) on a grid of world sizes and message sizes, for notebook 02's chart."""
from __future__ import annotations

from refimpl.cost.alpha_beta import halving_doubling_seconds, ring_seconds


def all_reduce_rows(world_sizes, sizes_bytes, alpha: float, beta: float) -> list[dict]:
    """Alpha-beta time of both all-reduce algorithms per world size and message size (a plot)."""
    return [{"ranks": n, "size_bytes": m, "algorithm": name, "seconds": seconds}
            for n in world_sizes for m in sizes_bytes
            for name, seconds in (("ring", ring_seconds("all_reduce", m, n, alpha, beta)),
                                  ("halving-doubling", halving_doubling_seconds(m, n, alpha, beta)))]
