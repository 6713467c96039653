"""The one table of what each collective puts on the wire: bytes a rank sends per byte of message.

For a message of M bytes on n ranks, with the bandwidth-optimal algorithms (Patarasuk & Yuan 2009
for the ring; Thakur et al. 2005 for the others):

    all_reduce      ring: reduce-scatter then all-gather      2(n-1)/n * M
    reduce_scatter  ring                                       (n-1)/n * M   M = one rank's input
    all_gather      ring                                       (n-1)/n * M   M = the gathered output
    all_to_all      pairwise exchange                          (n-1)/n * M   M = one rank's buffer
    broadcast, reduce, send_recv                               M

This is also nccl-tests' bus-bandwidth factor (busbw = algbw x factor, doc/PERFORMANCE.md), and,
for n -> infinity, the ZeRO paper's unit count (Rajbhandari et al. 2020, §7: all-reduce 2Ψ,
reduce-scatter and all-gather Ψ each). Everything else that needs these numbers imports them from
here: the sweep (refimpl.lab.measure.bench), the per-strategy table (refimpl.cost.strategy_cost), the
volume counted from traces (refimpl.cost.volume). refimpl.lab.measure.traffic predicts the exact integer
bytes of our own implementations, uneven chunks included, and tests them against this table.
"""
from __future__ import annotations

import math

_ALL_TO_ONE = ("broadcast", "reduce", "send_recv")


def bytes_per_rank_factor(op: str, n: float) -> float:
    """Bytes one rank sends per byte of message; n may be math.inf (the paper's large-n limit)."""
    if op in _ALL_TO_ONE:
        return 1.0
    share = 1.0 if n == math.inf else (n - 1) / n
    if op in ("all_reduce", "all_reduce_max"):
        return 2 * share
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return share
    raise ValueError(f"no bytes-per-rank factor for {op!r}")


def sent_per_rank(op: str, n: int, message_bytes: float) -> float:
    return bytes_per_rank_factor(op, n) * message_bytes


def wire_bytes(calls: list[dict]) -> float:
    """Bytes one rank sends for a CommLog's calls (refimpl.labels): each message times its
    factor on the call's own group size."""
    return sum(sent_per_rank(c["op"], c["world"], c["bytes"]) for c in calls)


def paper_factor(op: str) -> float:
    """The ZeRO paper's units: all-reduce 2, reduce-scatter / all-gather / reduce 1."""
    return bytes_per_rank_factor(op, math.inf)
