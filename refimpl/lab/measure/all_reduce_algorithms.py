"""refimpl.comm's all-reduce algorithms timed against each other on the same ranks and sizes, and
the tree checked against torch.distributed's all-reduce (notebook 02, section 4d).

Each repetition runs every algorithm once, in an order that rotates from one repetition to the
next, after a barrier, timed as the slowest rank (refimpl.lab.measure.bench's rule): load that
comes and goes on a shared machine then hits every algorithm alike (bench.head_to_head_rank
explains why the order must take turns).
"""
from __future__ import annotations

import pandas as pd
import torch
from torch.distributed import ReduceOp

import refimpl.comm as comm
from refimpl.lab.instrument.labels import CommLog
from refimpl.lab.measure.bench import _rank_device, _slowest_rank, _timed
from refimpl.launch import run


def time_algorithms_rank(rank: int, world_size: int, sizes_bytes, algorithms=("ring", "tree"),
                         repeats: int = 15, warmup: int = 3) -> list[dict] | None:
    """Runs on every rank: median (and best) time of each algorithm at each size; rank 0 returns rows."""
    import torch.distributed as dist

    device = _rank_device()
    rows = []
    for size in sizes_bytes:
        x = torch.ones(max(1, size // 4), device=device)
        times = {a: [] for a in algorithms}
        for i in range(warmup + repeats):
            k = i % len(algorithms)
            for algorithm in algorithms[k:] + algorithms[:k]:
                dist.barrier()
                t = _timed(lambda: comm.all_reduce(x, algorithm=algorithm), device)
                if i >= warmup:
                    times[algorithm].append(t)
        for algorithm in algorithms:
            slowest = _slowest_rank(times[algorithm], device)
            rows.append({"algorithm": algorithm, "world_size": world_size, "size_bytes": x.numel() * 4,
                         "median_s": float(slowest.median()), "min_s": float(slowest.min())})
    return rows if rank == 0 else None


def tree_against_torch(rank: int, world_size: int, numel: int = 1001) -> dict:
    """Runs on every rank: the tree all-reduce beside torch.distributed.all_reduce on the same small
    integers stored as floats (exact in any order, so equal means bit for bit) for SUM, MAX and AVG
    (gloo has no AVG: torch's side is SUM / n), and what this rank sent and received in one tree."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(-8, 9, (numel,), generator=gen).float().to(_rank_device())
    equal = {}
    for name, op in (("sum", ReduceOp.SUM), ("max", ReduceOp.MAX), ("avg", ReduceOp.AVG)):
        ours, theirs = x.clone(), x.clone()
        comm.all_reduce(ours, op=op, algorithm="tree")
        dist.all_reduce(theirs, op=ReduceOp.SUM if name == "avg" else op)
        equal[name] = torch.equal(ours, theirs / world_size if name == "avg" else theirs)
    with CommLog() as counted:
        comm.all_reduce(x.clone(), algorithm="tree")
    return {"equal": equal, "sent": counted.sent.get("all_reduce", 0),
            "received": counted.received.get("all_reduce", 0), "messages": counted.messages.get("all_reduce", 0)}


def _check_then_time(rank: int, world_size: int, numel: int, sizes_bytes, repeats: int):
    return tree_against_torch(rank, world_size, numel), time_algorithms_rank(
        rank, world_size, sizes_bytes, ("ring", "tree"), repeats)


def tree_vs_ring(world_size: int, sizes_bytes, numel: int = 1001, repeats: int = 15,
                 backend: str = "auto") -> tuple[list[dict], pd.DataFrame]:
    """One launch of fresh ranks: `tree_against_torch` on each, then the ring and the tree timed
    (`time_algorithms_rank`). Returns (each rank's check, one row per algorithm and size)."""
    per_rank = run(_check_then_time, world_size, numel=numel, sizes_bytes=list(sizes_bytes),
                   repeats=repeats, backend=backend, quiet=True)
    return [checked for checked, _ in per_rank], pd.DataFrame(per_rank[0][1])
