"""What a pipeline sends point to point, from the tables and from a traced run (notebook 07 §5).

Per micro-batch every stage boundary carries the activation forward and its gradient back: b·s·h
values each way (Narayanan et al. 2021, §3.2; refimpl.lab.predict.tp_comm.pp_boundary_bytes), against
tensor parallelism's 8·b·s·h·(t−1)/t per *layer*. With p ranks and v chunks per rank (interleaved
1F1B) a micro-batch crosses v·p − 1 boundaries instead of p − 1, so a step sends
2·m·(v·p − 1) messages: about v times 1F1B's (Narayanan et al. 2021, §2.2.2, the price of the
interleaved schedule's smaller bubble).

The runner labels every send `comm:isend <bytes>B` (refimpl.parallel.pp.runner), so a trace
gives the measured count and bytes to set beside it.

Memory. In Megatron-LM's interleaved schedule (megatron/core/pipeline_parallel/schedules.py) rank r
runs (p − r − 1)·2 + (v − 1)·p chunk forwards in warm-up, then one more before its first backward:
that many chunks, each 1/v of a stage, are in flight at its peak, more than 1F1B's p − r stages on
the early ranks (the price of the smaller bubble).
"""
from __future__ import annotations

import pandas as pd


def messages_per_step(stages: int, micro_batches: int, virtual_stages: int = 1) -> int:
    """Point-to-point messages of one step over all ranks: each micro-batch crosses every boundary
    between consecutive pieces twice (activation forward, gradient backward)."""
    return 2 * micro_batches * (virtual_stages * stages - 1)


def traced_sends(trace: pd.DataFrame) -> pd.DataFrame:
    """From `load_trace(run)`: per profiled step and rank, the isend calls and their bytes."""
    sends = trace[trace.step.notna() & (trace.op == "isend")]
    return (sends.groupby(["step", "rank"]).bytes.agg(["count", "sum", "max"])
            .rename(columns={"count": "sends", "sum": "bytes", "max": "message bytes"}).reset_index())


def interleaved_peak_chunks(stages: int, rank: int, virtual_stages: int) -> int:
    """Megatron-LM's warm-up forwards on `rank` plus the first steady-state one: the chunks in flight
    at its peak (for enough micro-batches: m >= p)."""
    return (stages - rank - 1) * 2 + (virtual_stages - 1) * stages + 1
