"""Bytes each rank sends in each rebuilt collective: predicted from the algorithm, and counted.

The prediction is per rank and exact, chunk by chunk, so a notebook can assert equality rather
than "about right". For the ring and pairwise collectives, with a tensor that divides evenly, it
is refimpl.cost.collective_bytes' table (the one place those factors are written; a test checks
that both agree); with uneven chunks it is the exact integer. The tree and linear collectives
send unevenly by design:

    all_reduce (halving-      2(p-1)/p * M   p = 2^k ranks; on other counts the folded ranks
               doubling)                     also send M in or out (halving_doubling.py)
    all_reduce (tree)          M per message the binomial reduce to rank 0 (M from every other
                                             rank), then the broadcast (M per child)
    broadcast (binomial)       M per child   root sends most: ceil(log2 n) * M
    reduce (binomial)          M             every rank but the root, once
    scatter / gather           (n-1)/n * M at the root / M/n from each other rank
"""
from __future__ import annotations

import pandas as pd
import torch

import refimpl.comm as comm
from refimpl.comm import halving_doubling
from refimpl.comm.ring import ALGORITHMS
from refimpl.lab.instrument.labels import CommLog
from refimpl.launch import device_for

HALVING_DOUBLING = "all_reduce (halving-doubling)"
COLLECTIVES = ("all_reduce", HALVING_DOUBLING, "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce",
               "scatter", "gather")


def _chunk_bytes(numel: int, n: int, itemsize: int) -> list[int]:
    return [t.numel() * itemsize for t in torch.empty(numel, dtype=torch.uint8).tensor_split(n)]


def all_reduce_lower_bound(n: int, m: float) -> float:
    """Fewest bytes a rank must send in any all-reduce of M bytes on n ranks: 2(n-1)/n * M.

    Patarasuk & Yuan 2009, §3 (and Chan et al. 2007): every element of the result depends on all
    n inputs. With the reduction work split evenly, a rank's inputs for the (n-1)/n of the
    elements that others reduce must leave it once, and the 1/n it finishes must reach the others:
    (n-1)/n * M out for the reduction, (n-1)/n * M of results in, and as much out again.
    """
    return 2 * (n - 1) / n * m


def binomial_children(v: int, n: int) -> int:
    """How many ranks the (root-relative) rank v sends to in a binomial-tree broadcast."""
    children, mask = 0, 1
    while mask < n:
        if v < mask and v + mask < n:
            children += 1
        mask <<= 1
    return children


def expected_sent(op: str, rank: int, n: int, numel: int, itemsize: int = 4, root: int = 0) -> int:
    """Bytes rank `rank` sends in refimpl.comm's `op` on a `numel`-element tensor (see docstring)."""
    m = numel * itemsize
    if n == 1:
        return 0
    if op == HALVING_DOUBLING:
        return halving_doubling_sent(rank, n, numel, itemsize)[0]
    if op == "all_reduce":  # reduce-scatter sends every chunk but its own, all-gather all but r+1's
        chunks = _chunk_bytes(numel, n, itemsize)
        return 2 * m - chunks[rank] - chunks[(rank + 1) % n]
    block = (numel // n) * itemsize  # these move n equal blocks; a remainder is not part of M
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) * block
    if op == "broadcast":
        return binomial_children((rank - root) % n, n) * m
    if op == "reduce":
        return 0 if rank == root else m
    if op == "scatter":
        return (n - 1) * block if rank == root else 0
    if op == "gather":
        return 0 if rank == root else block
    raise ValueError(f"no prediction for {op!r}")


def measure_sent(rank: int, world_size: int, numel: int) -> dict:
    """Run each collective on a `numel`-element fp32 tensor (the M of the table) under a CommLog.

    For reduce_scatter M is the input, for all_gather the output, for scatter/gather the root's
    whole list, so every row of the table is about the same M.
    """
    import torch.distributed as dist

    n = world_size
    piece = numel // n
    with torch.device(device_for(dist.get_backend())), CommLog() as counted:
        x = torch.ones(numel)
        comm.all_reduce(x.clone())
        comm.reduce_scatter_tensor(torch.empty(piece), x[: piece * n].clone())
        comm.all_gather_into_tensor(torch.empty(piece * n), torch.ones(piece))
        comm.all_to_all_single(torch.empty(piece * n), x[: piece * n].clone())
        comm.broadcast(x.clone(), src=0)
        comm.reduce(x.clone(), dst=0)
        comm.scatter(torch.empty(piece), list(x[: piece * n].chunk(n)) if rank == 0 else None, src=0)
        comm.gather(torch.ones(piece), [torch.empty(piece) for _ in range(n)] if rank == 0 else None,
                    dst=0)
        sent = {op: counted.sent.get(op, 0) for op in COLLECTIVES}
        sent[HALVING_DOUBLING] = all_reduce_sent(numel, "halving-doubling")[0]
    return sent


def all_reduce_sent(numel: int, algorithm: str) -> tuple[int, int]:
    """(bytes, messages) this rank sends in one fp32 all-reduce of `numel` values by `algorithm`.

    A counter of its own: both algorithms are the collective "all_reduce" to the counter.
    """
    with CommLog() as counted:
        comm.all_reduce(torch.ones(numel), algorithm=algorithm)
    return counted.sent.get("all_reduce", 0), counted.messages.get("all_reduce", 0)


def all_reduce_messages(rank: int, world_size: int, numel: int) -> dict:
    """Per algorithm, the (bytes, messages) this rank sent: run on ranks by launch.run."""
    import torch.distributed as dist


    with torch.device(device_for(dist.get_backend())):
        return {algorithm: all_reduce_sent(numel, algorithm) for algorithm in ALGORITHMS}


def traffic_table(measured: list[dict], numel: int, itemsize: int = 4) -> pd.DataFrame:
    """Counted vs predicted bytes sent, per collective and rank, and counted / M."""
    n = len(measured)
    m = numel * itemsize
    rows = [{"collective": op, "rank": r, "sent_bytes": measured[r][op],
             "predicted_bytes": expected_sent(op, r, n, numel, itemsize),
             "sent / M": measured[r][op] / m}
            for op in COLLECTIVES for r in range(n)]
    return pd.DataFrame(rows)


def halving_doubling_sent(rank: int, n: int, numel: int, itemsize: int = 4) -> tuple[int, int]:
    """(bytes, messages) that `rank` sends in the all-reduce of a `numel`-element tensor."""
    p, r = halving_doubling.fold(n)
    sent = []                                          # sizes in elements of each send
    if rank < 2 * r and rank % 2 == 0:
        sent.append(numel)                             # fold-in; then it sits out
    v = halving_doubling.virtual_rank(rank, n)
    if v is not None:
        sizes = [len(c) for c in torch.empty(numel, dtype=torch.uint8).tensor_split(p)]
        lo, hi, d = 0, p, p // 2
        while d >= 1:
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
            sent.append(sum(sizes[give[0]: give[1]]))
            lo, hi = keep
            d //= 2
        d = 1
        while d < p:
            sent.append(sum(sizes[lo:hi]))
            lo, hi = (lo, 2 * hi - lo) if v & d == 0 else (2 * lo - hi, hi)
            d *= 2
        if rank < 2 * r:
            sent.append(numel)                         # fold-out, to the even partner
    sent = [k for k in sent if k]
    return sum(sent) * itemsize, len(sent)



def tree_sent(rank: int, n: int, numel: int, itemsize: int = 4) -> tuple[int, int]:
    """(bytes, messages) that `rank` sends in the tree all-reduce (root 0) of `numel` values: its
    partial result to its parent (every rank but the root), then the result to each broadcast child."""
    messages = (rank != 0) + binomial_children(rank, n)
    return messages * numel * itemsize, messages
