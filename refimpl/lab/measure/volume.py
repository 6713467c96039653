"""Communication volume per step, counted from a trace's labelled collectives, in the ZeRO paper's units.

Rajbhandari et al. 2020, §7, count what one rank sends per step in units of Ψ, the number of
model parameters, for a ring implementation of large messages: a reduce-scatter or an all-gather
of a Ψ-element tensor moves Ψ (precisely (n-1)/n · Ψ), an all-reduce -- a reduce-scatter followed
by an all-gather -- moves 2Ψ. Hence plain DP 2Ψ, ZeRO-2 2Ψ, ZeRO-3 3Ψ (parameters gathered for
forward, again for backward, gradients reduce-scattered).

Every collective in refimpl is wrapped in `comm_span(op, nbytes)` with the size of the whole
message (the gathered buffer, the tensor reduced), so the volume is Σ factor(op) · bytes over the
labelled calls of a step. A `reduce` to one owner counts 1: ZeRO-2 builds its reduce-scatter from
per-bucket reduces, whose messages add up to Ψ.
"""
from __future__ import annotations

import math
from pathlib import Path

from refimpl.cost.collective_bytes import bytes_per_rank_factor
from refimpl.lab.trace.profiling import comm_table, load_trace

# the ZeRO paper's units (the large-n limit): all-reduce 2, reduce-scatter / all-gather / reduce 1
PAPER_FACTOR = {op: bytes_per_rank_factor(op, math.inf) for op in ("all_reduce", "reduce_scatter", "all_gather", "reduce")}


def volume_per_step(run: str | Path, min_bytes: int = 1024):
    """Per rank and op: calls, message bytes and volume (factor x bytes) per profiled step.

    Collectives smaller than `min_bytes` (the all-reduce of the scalar loss) are left out.
    """
    df = load_trace(run)
    steps = df[df.category == "step"].groupby("rank").size()
    labelled = df[(df.category == "comm") & df.name.str.startswith("comm:") & df.step.notna()
                  & (df.bytes.fillna(0) >= min_bytes)]
    table = comm_table(labelled)
    table["steps"] = table["rank"].map(steps)
    table["calls_per_step"] = table["count"] / table["steps"]
    table["bytes_per_step"] = table["bytes"] / table["steps"]
    table["volume_per_step"] = table["op"].map(PAPER_FACTOR) * table["bytes_per_step"]
    return table[["rank", "op", "calls_per_step", "bytes_per_step", "volume_per_step"]]


def total_volume(run: str | Path, min_bytes: int = 1024) -> dict[int, float]:
    """rank -> bytes per step, summed over ops with the paper's factors."""
    table = volume_per_step(run, min_bytes)
    return {int(r): float(g.volume_per_step.sum()) for r, g in table.groupby("rank")}
