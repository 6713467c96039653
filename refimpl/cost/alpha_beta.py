"""The alpha-beta model of a collective (seed §2.2): a message of n bytes takes T = alpha + n / beta;
a ring all-reduce of M bytes on p ranks 2(p-1)·alpha + 2(p-1)/p · M / beta; halving-doubling and the
tree trade the ring's steps for bytes (`crossover_bytes`). Fitted by `fit_alpha_beta`."""
from __future__ import annotations

import math

import numpy as np

from refimpl.comm import tree
from refimpl.comm.halving_doubling import bytes_on_critical_path, messages_per_rank
from refimpl.cost.collective_bytes import bytes_per_rank_factor

busbw_factor = bytes_per_rank_factor   # nccl-tests' bus-bandwidth factor (op, world size): the same table


def ring_steps(op: str, n: int) -> int:
    """Message steps on a ring collective's critical path, each paying alpha once."""
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter"):
        return n - 1
    raise ValueError(f"no ring for {op!r}")


def ring_seconds(op: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Time of one ring `op` of an `nbytes` message on n ranks (0 on one rank)."""
    if n <= 1:
        return 0.0
    return ring_steps(op, n) * alpha + bytes_per_rank_factor(op, n) * nbytes / beta


def halving_doubling_seconds(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Rabenseifner's all-reduce: 2 log2(p) alpha + 2 (p-1)/p M / beta on p = 2^k ranks."""
    return messages_per_rank(n) * alpha + bytes_on_critical_path(n, nbytes) / beta


def tree_seconds(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """The tree all-reduce (reduce to a root, then broadcast): 2 ceil(log2 p) (alpha + M / beta)."""
    return tree.messages_on_critical_path(n) * alpha + tree.bytes_on_critical_path(n, nbytes) / beta


def crossover_bytes(n: int, alpha: float, beta: float, other: str = "halving-doubling") -> float:
    """Message size above which the ring all-reduce beats `other` (halving-doubling or tree) on n
    ranks: where the other's saved latencies equal its extra bytes (inf: never; 0: at every size)."""
    if other == "halving-doubling":     # its messages and bytes per byte of M, critical path
        messages, per_byte = messages_per_rank(n), bytes_on_critical_path(n, 1.0)
    elif other == "tree":
        messages, per_byte = tree.messages_on_critical_path(n), tree.bytes_on_critical_path(n, 1.0)
    else:
        raise ValueError(f"no all-reduce {other!r} beside the ring")
    extra_alpha = ring_steps("all_reduce", n) - messages            # the ring's extra steps
    extra_bytes = per_byte - bytes_per_rank_factor("all_reduce", n)  # the other's extra bytes per byte
    if extra_bytes <= 0:
        return math.inf
    return max(0.0, extra_alpha * alpha * beta / extra_bytes)


def hop_model_from_fit(alpha_s: float, beta_bytes_per_s: float,
                       world_size: int = 2) -> tuple[float, float]:
    """(alpha per ring step, beta) from a fit T = alpha + M / beta of an all-reduce on `world_size`
    ranks (M: the bytes each link carries): the ring's 2(n-1) steps share the fitted alpha."""
    return alpha_s / (2 * (world_size - 1)), beta_bytes_per_s


def fit_alpha_beta(sizes_bytes, seconds) -> tuple[float, float]:
    """Least-squares fit of T = alpha + M / beta; returns (alpha in s, beta in bytes/s)."""
    m = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    a = np.stack([1.0 / t, m / t], axis=1)  # rows scaled by 1/T: weighted least squares
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:  # refit with alpha = 0: T = M / beta
        alpha, inv_beta = 0.0, float(np.sum(m / t) / np.sum((m / t) ** 2))
    if inv_beta <= 0:  # refit with no bandwidth term: T = alpha
        alpha, inv_beta = float(np.sum(1.0 / t) / np.sum((1.0 / t) ** 2)), 0.0
    return float(alpha), (1.0 / inv_beta if inv_beta > 0 else float("inf"))


def predict_seconds(alpha: float, beta: float, sizes_bytes) -> np.ndarray:
    """The fitted line T = alpha + M / beta at each size."""
    return alpha + np.asarray(sizes_bytes, dtype=float) / beta
