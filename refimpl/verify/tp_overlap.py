"""`--set tp_overlap=true` measured beside its α-β prediction (notebook 06, scripts/bench_tp.py).

    m = measure(nproc=2, alpha_hop=..., link=...)   # the α-β hop model of this machine (notebook 06 §7)
    m["steps"]          median step seconds of tp + SP and of tp + SP + tp_overlap, interleaved rounds
    m["transfers"]      one row per ring step of one profiled overlapped step on rank 0: its range's
                        duration and the duration of the chunk matmul inside it
    m["predicted_saving_s"]   per step, Σ over those ring steps of min(σ·(α_hop + m/B), c)
                        (tp_comm.hidden_per_ring_step, the term of decomposed_ring_seconds), σ the
                        share of a transfer that runs beside the matmul on these ranks
                        (m["engine_share"], tp_comm.transfer_engine_share: 0 for CPU ranks that
                        occupy every core)
    m["saving_if_free_s"]     the same with σ = 1: what a copy engine beside each matmul would hide

The step times come from unprofiled runs; the trace from a third, profiled one.
"""
from __future__ import annotations

import pandas as pd

from refimpl.config import DTYPES, TrainConfig
from refimpl.cost.tp_comm import hidden_per_ring_step, transfer_engine_share
from refimpl.env import cpu_cores
from refimpl.launch import device_for, pick_backend
from refimpl.trace import capture, profiling
from refimpl.verify.step_time import step_times_in_rounds

OVERLAP = {"tp_overlap": True}


def transfers_of(trace, rank: int = 0):
    """Per ring step of the profiled steps: the transfer range and the matmul range inside it."""
    ours = trace[(trace["rank"] == rank) & trace.step.notna() & trace.name.str.startswith("tp:ring")]
    matmuls = ours[ours.name.str.contains(" matmul ")]
    rows = []
    for t in ours[ours.name.str.endswith((" in", " out"))].itertuples():
        inside = matmuls[(matmuls.start_us >= t.start_us)
                         & (matmuls.start_us + matmuls.dur_us <= t.start_us + t.dur_us)]
        rows.append({"step": t.step, "transfer": t.name, "transfer_us": t.dur_us,
                     "matmuls inside": len(inside), "matmul_us": inside.dur_us.sum()})
    return pd.DataFrame(rows)


def measure(nproc: int, alpha_hop: float, link: float, *, steps: int = 4, rounds: int = 2,
            **train) -> dict:
    base = TrainConfig(strategy="tp", nproc=nproc, steps=steps, sequence_parallel=True).with_(**train)
    medians, last = step_times_in_rounds({"tp+SP": base, "tp_overlap": base.with_(options=OVERLAP)},
                                         rounds)
    profiled = base.with_(options=OVERLAP, profile=True,
                          trace_dir=str(capture.run_dir("06_tensor_parallel", "tp_overlap")))
    step_times_in_rounds({"profiled": profiled}, 1)
    # our tp:ring ranges are not comm labels: the loader keeps them with the ops
    transfers = transfers_of(profiling.load_trace(profiled.trace_dir, include_ops=True))
    per_step = transfers.groupby("step")
    chunk_bytes = (base.global_batch * base.seq_len // nproc * base.model.d_model
                   * DTYPES[base.dtype].itemsize)
    share = transfer_engine_share(device_for(pick_backend(nproc)).type, nproc, cpu_cores())

    def saving(engine_share: float) -> float:
        # each ring step: the model's transfer of one chunk against the matmul measured beside it
        return sum(hidden_per_ring_step(chunk_bytes, c / 1e6, alpha_hop, link, engine_share)
                   for c in transfers.matmul_us) / per_step.ngroups

    return {"steps": medians, "losses": {k: r["losses"] for k, r in last.items()},
            "transfers": transfers, "transfers_per_step": per_step.size().median(),
            "chunk_bytes": chunk_bytes, "engine_share": share,
            "predicted_saving_s": saving(share), "saving_if_free_s": saving(1.0)}
