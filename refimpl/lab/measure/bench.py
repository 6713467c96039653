"""What a collective costs, measured: a bandwidth sweep as nccl-tests runs it (seed, section 2.3).
The alpha-beta model T = alpha + M / beta fitted to it, and the bus-bandwidth factor, are
refimpl.cost.alpha_beta's.

Two bandwidths per measurement, as in nccl-tests (doc/PERFORMANCE.md):

* algbw = M / t, with M the message size as nccl-tests defines it (the tensor for all_reduce,
  broadcast, reduce; the gathered output for all_gather; the input for reduce_scatter; one rank's
  buffer for all_to_all and send_recv);
* busbw = algbw * busbw_factor(op, n): the bytes each rank's link really carries per second, so
  different collectives and world sizes can be compared against one hardware limit. A ring
  all-reduce moves 2(n-1)/n * M per rank, hence its factor.

`sweep` times torch.distributed's built-ins and refimpl.comm's rebuilds side by side (same API, so
same code), on fresh ranks, and returns a DataFrame. The ceiling a sweep is compared with is the
device's own (refimpl.lab.measure.ceilings, re-exported here): one core's memcpy for CPU ranks on gloo,
the peer (or device-to-device) copy for GPU ranks on NCCL; `max_message_bytes(backend)` is the
sweep's largest size per device (MBs on CPU, a GB on GPUs, where links plateau late).
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import refimpl.comm as comm
from refimpl.cost.alpha_beta import busbw_factor, fit_alpha_beta, predict_seconds
from refimpl.lab.measure.ceilings import (  # noqa: F401
    ceiling_for,
    copy_sweep,
    cuda_copy_bandwidth,
    max_message_bytes,
    memcpy_bandwidth,
)
from refimpl.lab.progress import progress_bar  # a widget in a notebook, text in a terminal
from refimpl.launch import device_for, run
from refimpl.seam import lookup

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send_recv")
IMPLS = ("torch", "refimpl")


def message_sizes(min_bytes: int = 4, max_bytes: int = 64 << 20, factor: int = 2) -> list[int]:
    """Geometric sizes from min_bytes to max_bytes (inclusive), as nccl-tests' -b -e -f."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def _buffers(op: str, size_bytes: int, n: int, device="cpu"):
    """(input, output, M) for a nominal size: fp32, at least one element per rank's block."""
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        block = max(1, size_bytes // 4 // n)
        numel_in, numel_out = {"all_gather": (block, block * n), "reduce_scatter": (block * n, block),
                               "all_to_all": (block * n, block * n)}[op]
        m = block * n * 4
    else:
        numel_in = numel_out = max(1, size_bytes // 4)
        m = numel_in * 4
    return torch.ones(numel_in, device=device), torch.empty(numel_out, device=device), m


def _rank_device():
    """This rank's device: its GPU under NCCL (then timing needs a synchronize), else the CPU."""
    import torch.distributed as dist

    return device_for(dist.get_backend())


def _timed(fn, device) -> float:
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _slowest_rank(times: list[float], device):
    """Each repetition's time on the slowest rank (the collective is done when the last rank is)."""
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu()


def _call(c, op: str, x, out, rank: int, n: int) -> None:
    """One collective through module `c` (torch.distributed or refimpl.comm: the same API)."""
    if op == "all_reduce":
        c.all_reduce(x)
    elif op == "all_gather":
        c.all_gather_into_tensor(out, x)
    elif op == "reduce_scatter":
        c.reduce_scatter_tensor(out, x)
    elif op == "all_to_all":
        c.all_to_all_single(out, x)
    elif op == "broadcast":
        c.broadcast(x, src=0)
    elif op == "reduce":
        c.reduce(x, dst=0)
    elif op == "send_recv":  # every rank sends to its right neighbour, receives from its left
        # Even ranks send first, odd ranks receive first: under NCCL's order (a rank's operations
        # run in posting order, a send completes once its receive has started) every rank
        # receiving first would hang the ring (refimpl.lab.runtime.staged_stream; nccl_order.replay agrees).
        # point-to-point is torch's own on both sides (refimpl.comm is built from it)
        send = lambda: lookup(c, "isend")(x, dst=(rank + 1) % n)         # noqa: E731
        recv = lambda: lookup(c, "irecv")(out, src=(rank - 1) % n)       # noqa: E731
        works = [send(), recv()] if rank % 2 == 0 else [recv(), send()]
        for w in works:
            w.wait()
    else:
        raise ValueError(f"unknown op {op!r}")


def sweep_rank(rank: int, world_size: int, ops=OPS, sizes=None, impls=IMPLS, warmup: int = 2,
               repeats: int = 5, progress_file: str | None = None) -> list[dict] | None:
    """Runs on every rank: time each (op, impl, size); rank 0 returns the rows.

    Each repetition starts after a barrier and its time is the slowest rank's, the moment the
    collective is complete everywhere; the row keeps the median over repetitions.
    """
    import torch.distributed as dist

    modules = {"torch": dist, "refimpl": comm}
    sizes = sizes or message_sizes()
    rows, n, device = [], world_size, _rank_device()
    for op in ops:
        for size in sizes:
            x, out, m = _buffers(op, size, n, device)
            for impl in impls:
                times = []
                for i in range(warmup + repeats):
                    dist.barrier()
                    times.append(_timed(lambda: _call(modules[impl], op, x, out, rank, n), device))
                t = float(_slowest_rank(times[warmup:], device).median())
                rows.append({"impl": impl, "op": op, "world_size": n, "nominal_bytes": size,
                             "size_bytes": m, "time_s": t,
                             "algbw": m / t, "busbw": m / t * busbw_factor(op, n)})
                if progress_file and rank == 0:
                    with open(progress_file, "a") as f:
                        f.write(".")
    return rows if rank == 0 else None


def sweep(world_sizes=(2,), ops=OPS, sizes=None, impls=IMPLS, warmup: int = 2, repeats: int = 5,
          progress: bool = True, timeout: float = 1800.0, backend: str = "auto") -> pd.DataFrame:
    """Bandwidth sweep on fresh ranks, one launch per world size; a progress bar counts points.
    `backend` as refimpl.launch.run's ("gloo" keeps the ranks on CPU on a GPU machine).

    Columns: impl, op, world_size, nominal_bytes (the size asked for), size_bytes (M as measured:
    block collectives round to n equal blocks of whole fp32 values), time_s (median), algbw,
    busbw (bytes/s).
    """
    sizes = list(sizes or message_sizes())
    frames = []
    for n in world_sizes:
        total = len(ops) * len(sizes) * len(impls)
        rows = _run_with_progress(n, total, progress, dict(
            ops=tuple(ops), sizes=sizes, impls=tuple(impls), warmup=warmup, repeats=repeats),
            timeout, backend)
        frames.append(pd.DataFrame(rows))
    return pd.concat(frames, ignore_index=True)


def _run_with_progress(n: int, total: int, progress: bool, kwargs: dict, timeout: float,
                       backend: str = "auto") -> list:
    """launch.run in a helper thread while this one advances a progress bar from rank 0's tally file.

    The ranks' own output only reaches us when they exit, so progress travels through a file.
    """
    if not progress:
        return run(sweep_rank, n, timeout=timeout, quiet=True, backend=backend, **kwargs)[0]

    with tempfile.TemporaryDirectory(prefix="refimpl-sweep-") as tmp:
        tally = Path(tmp) / "progress"
        tally.touch()
        box: dict = {}

        def target():
            try:
                box["rows"] = run(sweep_rank, n, timeout=timeout, quiet=True, backend=backend,
                                  progress_file=str(tally), **kwargs)[0]
            except BaseException as e:  # re-raised below, in the caller's thread
                box["error"] = e

        worker = threading.Thread(target=target, daemon=True)
        worker.start()
        with progress_bar(total, desc=f"sweep, {n} ranks", unit="pt", mininterval=2.0) as bar:
            while worker.is_alive():
                worker.join(0.2)
                bar.update(os.path.getsize(tally) - bar.n)
            bar.update(os.path.getsize(tally) - bar.n)
    if "error" in box:
        raise box["error"]
    return box["rows"]


def compare_impls(sweep_df: pd.DataFrame) -> pd.DataFrame:
    """Per (op, world_size, size): torch's and refimpl's busbw side by side and refimpl/torch."""
    wide = sweep_df.pivot_table(index=["op", "world_size", "size_bytes"], columns="impl",
                                values="busbw").reset_index()
    wide.columns.name = None
    wide["refimpl / torch"] = wide["refimpl"] / wide["torch"]
    return wide


def head_to_head_rank(rank: int, world_size: int, op: str = "all_reduce", size_bytes: int = 16 << 20,
                      repeats: int = 30, warmup: int = 3) -> list[dict] | None:
    """Runs on every rank: torch vs refimpl on one (op, size), alternating call by call, and who
    goes first taking turns (torch first on even repetitions, refimpl first on odd ones).

    Alternating matters on a shared machine: load that comes and goes then hits both sides
    alike, where timing all of one and then all of the other would charge it to whichever ran
    during the busy spell. Taking turns matters too: in a fixed order each side finds the machine
    as the other left it, and the ratio moved with the order (16 MB on 4 ranks, 2 cores: our ring
    took 1.01-1.08x gloo's time going after it every time in four runs, 0.98-1.02x taking turns
    in three).
    """
    import torch.distributed as dist

    modules = {"torch": dist, "refimpl": comm}
    device = _rank_device()
    x, out, m = _buffers(op, size_bytes, world_size, device)
    times = {impl: [] for impl in IMPLS}
    for i in range(warmup + repeats):
        for impl in IMPLS if i % 2 == 0 else IMPLS[::-1]:
            dist.barrier()
            t = _timed(lambda: _call(modules[impl], op, x, out, rank, world_size), device)
            if i >= warmup:
                times[impl].append(t)
    rows = []
    for impl in IMPLS:
        slowest = _slowest_rank(times[impl], device)
        t_med, t_min = float(slowest.median()), float(slowest.min())
        rows.append({"impl": impl, "op": op, "world_size": world_size, "size_bytes": m,
                     "median_s": t_med, "min_s": t_min,
                     "busbw_median": m / t_med * busbw_factor(op, world_size),
                     "busbw_best": m / t_min * busbw_factor(op, world_size)})
    return rows if rank == 0 else None


def head_to_head(op: str = "all_reduce", size_bytes: int = 16 << 20, world_size: int = 2,
                 repeats: int = 30) -> pd.DataFrame:
    """torch.distributed vs refimpl.comm on one collective and size, on fresh ranks."""
    rows = run(head_to_head_rank, world_size, op=op, size_bytes=size_bytes, repeats=repeats,
               quiet=True)[0]
    return pd.DataFrame(rows).set_index("impl")


# --- the alpha-beta fit of a sweep ---------------------------------------------------------

def fit_error(sizes_bytes, seconds, alpha: float, beta: float) -> dict:
    """How well the fitted line explains the data: R^2 of log T, median and worst relative error."""
    t = np.asarray(seconds, dtype=float)
    p = predict_seconds(alpha, beta, sizes_bytes)
    rel = np.abs(p - t) / t
    lt, lp = np.log(t), np.log(p)
    ss_res, ss_tot = float(np.sum((lt - lp) ** 2)), float(np.sum((lt - lt.mean()) ** 2))
    return {"r2_log": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "median_rel_err": float(np.median(rel)), "max_rel_err": float(np.max(rel))}


def fit_table(sweep_df: pd.DataFrame) -> pd.DataFrame:
    """One alpha-beta fit per (impl, op, world_size) of a sweep (`sweep`), with
    its error."""
    rows = []
    for (impl, op, n), g in sweep_df.groupby(["impl", "op", "world_size"], sort=False):
        alpha, beta = fit_alpha_beta(g.size_bytes, g.time_s)
        rows.append({"impl": impl, "op": op, "world_size": n, "alpha_s": alpha,
                     "beta_bytes_per_s": beta, **fit_error(g.size_bytes, g.time_s, alpha, beta)})
    return pd.DataFrame(rows)


def with_predictions(sweep_df: pd.DataFrame, fits: pd.DataFrame) -> pd.DataFrame:
    """The sweep plus each row's model time `predicted_s` (for predicted-vs-measured plots)."""
    df = sweep_df.merge(fits[["impl", "op", "world_size", "alpha_s", "beta_bytes_per_s"]],
                        on=["impl", "op", "world_size"])
    df["predicted_s"] = predict_seconds(df.alpha_s, df.beta_bytes_per_s, df.size_bytes)
    return df.drop(columns=["alpha_s", "beta_bytes_per_s"])
