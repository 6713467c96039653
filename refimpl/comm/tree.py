"""Broadcast and reduce on a binomial tree, and the tree all-reduce: the two back to back (seed
§2.3's tree beside the ring: 2 ceil(log2 n) messages of the whole M, against the ring's 2(n-1) of M/n)."""
from __future__ import annotations

import math

import torch
from torch.distributed import ReduceOp

from refimpl.comm.p2p import GroupView, exchange, nbytes
from refimpl.comm.reduce_ops import check_op, finish, reduce_into
from refimpl.comm.work import issue


def binomial_broadcast_(tensor: torch.Tensor, root: int, g: GroupView) -> None:
    n = g.size
    v = (g.rank - root) % n
    mask = 1
    while mask < n:
        if v < mask and v + mask < n:            # I have it: pass it on
            exchange(g, sends=[(tensor, (v + mask + root) % n)])
        elif mask <= v < 2 * mask:                # my turn to get it
            exchange(g, recvs=[(tensor, (v - mask + root) % n)])
        mask <<= 1


def binomial_reduce_(tensor: torch.Tensor, root: int, op, g: GroupView) -> None:
    """The root's `tensor` receives the reduction; other ranks' tensors are left unchanged."""
    n = g.size
    v = (g.rank - root) % n
    acc = tensor  # on a non-root rank, replaced by a private copy before anything is added to it
    incoming = None
    mask = 1
    while mask < n:
        if v & mask:                              # hand my partial result to my parent, done
            exchange(g, sends=[(acc, (v - mask + root) % n)])
            return
        if v + mask < n:                          # a child's partial result arrives
            if incoming is None:
                incoming = torch.empty_like(tensor)
                if v != 0:
                    acc = tensor.clone()
            exchange(g, recvs=[(incoming, (v + mask + root) % n)])
            reduce_into(acc, incoming, op)
        mask <<= 1
    finish(acc, op, n)  # only the root gets here


def tree_all_reduce_(flat: torch.Tensor, op, g: GroupView) -> None:
    """Every rank ends with the reduction: reduced up the tree to rank 0, then broadcast down it.
    Few steps (log2 n each way), but every step carries the whole message: the latency-optimal,
    bandwidth-poor end of the trade NCCL's pipelined double binary tree balances."""
    binomial_reduce_(flat, 0, op, g)
    binomial_broadcast_(flat, 0, g)


def rounds(n: int) -> int:
    """Rounds of a binomial tree on n ranks: ceil(log2 n)."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def messages_on_critical_path(n: int) -> int:
    """The alpha count of the tree all-reduce: the root receives one message per round, then sends one."""
    return 2 * rounds(n)


def bytes_on_critical_path(n: int, m: float) -> float:
    """The beta term's bytes: each of those 2 ceil(log2 n) messages is the whole M."""
    return messages_on_critical_path(n) * m


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """torch.distributed.broadcast: every rank's `tensor` <- the root's, in place."""

    def body(g: GroupView):
        binomial_broadcast_(tensor, g.group_rank(src, group_src), g)

    return issue("broadcast", group, async_op, body, nbytes(tensor))


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    """torch.distributed.reduce: the root's `tensor` <- op over every rank's `tensor`."""
    check_op(op)

    def body(g: GroupView):
        binomial_reduce_(tensor, g.group_rank(dst, group_dst), op, g)

    return issue("reduce", group, async_op, body, nbytes(tensor))
