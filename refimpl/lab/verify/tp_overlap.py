"""`--set tp_overlap=true` measured beside its α-β prediction (notebook 06, scripts/bench_tp.py).

    alpha_hop, link = hop_model_here(2)             # the α-β hop model of this machine (notebook 06 §7)
    m = measure(nproc=2, alpha_hop=alpha_hop, link=link)
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

    beside = transfer_beside_matmul()   # σ measured: how much of an exchange hides under a matmul
"""
from __future__ import annotations

import statistics
import time

import pandas as pd
import torch
import torch.distributed as dist

from refimpl.config import DTYPES
from refimpl.cost.alpha_beta import busbw_factor, fit_alpha_beta, hop_model_from_fit
from refimpl.lab.config import LabConfig
from refimpl.lab.env import cpu_cores
from refimpl.lab.measure.bench import message_sizes, sweep
from refimpl.lab.predict.tp_comm import hidden_per_ring_step, transfer_engine_share
from refimpl.lab.trace import capture, profiling
from refimpl.lab.verify.step_time import step_times_in_rounds
from refimpl.launch import device_for, pick_backend, run

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


def hop_model_here(world_size: int = 2) -> tuple[float, float]:
    """(α per ring step, link rate B) of torch's all_reduce on `world_size` ranks of this machine:
    a short sweep (1 KB to 4 MB) fitted as notebook 06 §7 does, the bytes counted per link."""
    df = sweep(world_sizes=(world_size,), ops=("all_reduce",), impls=("torch",),
               sizes=message_sizes(1 << 10, 4 << 20, 4), repeats=3, progress=False)
    link_bytes = df.size_bytes * busbw_factor("all_reduce", world_size)
    return hop_model_from_fit(*fit_alpha_beta(link_bytes, df.time_s), world_size)


def measure(nproc: int, alpha_hop: float, link: float, *, steps: int = 4, rounds: int = 2,
            **train) -> dict:
    base = LabConfig(strategy="tp", nproc=nproc, steps=steps, sequence_parallel=True).with_(**train)
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


def transfer_beside_matmul(n: int = 512, megabytes: int = 4, repeats: int = 20) -> dict:
    """σ of `tp_comm.transfer_engine_share`, measured on 2 ranks: each times a matmul of two n x n
    matrices alone (c), an exchange of `megabytes` with the other rank alone (T), and the exchange
    posted before the matmul and waited after it (both). The share of the shorter that was hidden,
    (c + T - both) / min(c, T), is 1 when the transfer runs on hardware of its own and 0 when it
    costs the matmul its full time. Twice: with both ranks multiplying (every core busy where
    cores = 2) and with rank 1 only exchanging (its core free for the copies). Returns rank 0's
    {"both multiply": σ, "one multiplies": σ} (medians over `repeats`)."""
    out = {}
    for lone in (False, True):
        times = run(_beside_rank, 2, n, megabytes, repeats, lone, quiet=True)[0]
        c, t, both = times["matmul"], times["transfer"], times["both"]
        out["one multiplies" if lone else "both multiply"] = (c + t - both) / min(c, t)
    return out


def _beside_rank(rank: int, world: int, n: int, megabytes: int, repeats: int, lone: bool) -> dict:
    device = device_for(dist.get_backend())
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    send = torch.randn(megabytes << 18, device=device)      # 4-byte values
    recv = torch.empty_like(send)
    peer = 1 - rank

    def post():    # rank 0 sends first, rank 1 receives first: NCCL's order pairs them
        ops = [lambda: dist.isend(send, peer), lambda: dist.irecv(recv, peer)]
        return [op() for op in (ops if rank == 0 else ops[::-1])]

    def both():
        works = post()
        if not (lone and rank == 1):
            a @ b
        for w in works:
            w.wait()

    kinds = {"matmul": lambda: a @ b, "transfer": lambda: [w.wait() for w in post()], "both": both}
    times = {k: [] for k in kinds}
    for i in range(repeats + 3):
        for kind, fn in kinds.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 3:
                times[kind].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()} if rank == 0 else None
