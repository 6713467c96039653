"""All-reduce by recursive halving and doubling (the "butterfly"), beside the ring."""
from __future__ import annotations

import itertools
import math

import torch

from refimpl.comm.p2p import GroupView, exchange
from refimpl.comm.reduce_ops import finish, reduce_into


def fold(n: int) -> tuple[int, int]:
    """(p, r): p the largest power of two <= n, r = n - p ranks folded into a partner."""
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def virtual_rank(rank: int, n: int) -> int | None:
    """This rank's index among the p ranks that run the butterfly; None if it sits out."""
    _, r = fold(n)
    if rank < 2 * r:
        return rank // 2 if rank % 2 else None
    return rank - r


def real_rank(v: int, n: int) -> int:
    """The group rank of butterfly member v (the inverse of `virtual_rank`)."""
    _, r = fold(n)
    return 2 * v + 1 if v < r else v + r


def halving_doubling_all_reduce_(flat: torch.Tensor, op, g: GroupView) -> None:
    """In place on the 1-D contiguous `flat`: every rank ends with the reduction over all ranks."""
    n, rank = g.size, g.rank
    p, r = fold(n)
    if rank < 2 * r:                                  # fold-in: evens hand their vector up
        if rank % 2 == 0:
            exchange(g, sends=[(flat, rank + 1)])
        else:
            incoming = torch.empty_like(flat)
            exchange(g, recvs=[(incoming, rank - 1)])
            reduce_into(flat, incoming, op)
    v = virtual_rank(rank, n)
    if v is not None:
        _butterfly(flat, op, g, v, p)
    if rank < 2 * r:                                  # fold-out: odds hand the result back
        if rank % 2:
            exchange(g, sends=[(flat, rank - 1)])
        else:
            exchange(g, recvs=[(flat, rank + 1)])


def _butterfly(flat: torch.Tensor, op, g: GroupView, v: int, p: int) -> None:
    """Butterfly member v of p (a power of two): halving reduce-scatter, then doubling all-gather."""
    n = g.size
    offsets = list(itertools.accumulate((c.numel() for c in flat.tensor_split(p)), initial=0))

    def span(lo: int, hi: int) -> torch.Tensor:      # chunks lo..hi-1 as one slice of flat
        return flat[offsets[lo]: offsets[hi]]

    distances = [1 << j for j in range(p.bit_length() - 1)]   # 1, 2, ..., p/2
    lo, hi = 0, p
    # the first round's kept half is the largest (tensor_split puts the longer chunks first)
    scratch = torch.empty(offsets[max(p // 2, 1)], dtype=flat.dtype, device=flat.device)
    for d in reversed(distances):                     # recursive halving: reduce-scatter
        peer, mid = real_rank(v ^ d, n), (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
        mine = span(*keep)
        incoming = scratch[: mine.numel()]
        exchange(g, sends=[(span(*give), peer)], recvs=[(incoming, peer)])
        reduce_into(mine, incoming, op)
        lo, hi = keep
    finish(span(lo, hi), op, n)                       # AVG: divide the chunk we own, once
    for d in distances:                               # recursive doubling: all-gather
        other = (hi, 2 * hi - lo) if v & d == 0 else (2 * lo - hi, lo)
        peer = real_rank(v ^ d, n)
        exchange(g, sends=[(span(lo, hi), peer)], recvs=[(span(*other), peer)])
        lo, hi = min(lo, other[0]), max(hi, other[1])


def messages_per_rank(n: int) -> int:
    """Messages on the critical path (the alpha count): 2 log2 p, plus 2 for a fold."""
    p, r = fold(n)
    return 2 * int(math.log2(p)) + (2 if r else 0)


def bytes_on_critical_path(n: int, m: float) -> float:
    """The beta term's bytes: 2 (p-1)/p * M, plus 2M for a fold (its send in and back out)."""
    p, r = fold(n)
    return 2 * (p - 1) / p * m + (2 * m if r else 0)
