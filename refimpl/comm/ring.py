"""Ring reduce-scatter, ring all-gather, and ring all-reduce = the two of them back to back
(seed 000 §2.1-2.3). Each of n ranks sends (n-1)/n·M per phase: 2(n-1)/n·M for the all-reduce.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed import ReduceOp

from refimpl.comm.halving_doubling import halving_doubling_all_reduce_
from refimpl.comm.p2p import GroupView, exchange, nbytes
from refimpl.comm.reduce_ops import check_op, finish, reduce_into
from refimpl.comm.tree import tree_all_reduce_
from refimpl.comm.work import issue
from refimpl.seam import plugins


@contextmanager
def _flat(tensor: torch.Tensor):
    """A 1-D contiguous view to run the ring on, written back if `tensor` was not contiguous."""
    if tensor.is_contiguous():
        yield tensor.view(-1)
    else:
        tmp = tensor.contiguous()
        yield tmp.view(-1)
        tensor.copy_(tmp)


def ring_reduce_scatter_(chunks: list[torch.Tensor], op, g: GroupView) -> None:
    """In place on `chunks` (one per rank): afterwards chunks[g.rank] is the reduction of all."""
    n, r = g.size, g.rank
    right, left = (r + 1) % n, (r - 1) % n
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
    for s in range(n - 1):
        mine = chunks[(r - s - 2) % n]
        incoming = scratch[:mine.numel()].view_as(mine)
        exchange(g, sends=[(chunks[(r - s - 1) % n], right)], recvs=[(incoming, left)])
        reduce_into(mine, incoming, op)


def reduce_scatter_ring(chunks: list[torch.Tensor], op, g: GroupView) -> None:
    """`ring_reduce_scatter_`, or the same steps the lab installs in its place (in segments through
    buffers kept from call to call, a speed-up on gloo: refimpl.lab.runtime.ring_segments)."""
    installed = plugins("refimpl.ring_reduce_scatter")
    (installed[0] if installed else ring_reduce_scatter_)(chunks, op, g)


def ring_all_gather_(chunks: list[torch.Tensor], g: GroupView) -> None:
    """In place on `chunks`: rank r contributes chunks[r]; afterwards every rank has all of them."""
    n, r = g.size, g.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        exchange(g, sends=[(chunks[(r - s) % n], right)], recvs=[(chunks[(r - s - 1) % n], left)])


ALGORITHMS = ("ring", "halving-doubling", "tree")
_NOT_RING = {"halving-doubling": halving_doubling_all_reduce_, "tree": tree_all_reduce_}


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, algorithm="ring"):
    """torch.distributed.all_reduce, in place: on a ring (reduce-scatter, then all-gather), or with
    `algorithm="halving-doubling"` by recursive halving and doubling (halving_doubling.py), or
    `algorithm="tree"` as a binomial reduce then broadcast (tree.py)."""
    check_op(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all_reduce algorithm must be one of {ALGORITHMS}, not {algorithm!r}")

    def body(g: GroupView):
        with _flat(tensor) as flat:
            if algorithm in _NOT_RING:
                _NOT_RING[algorithm](flat, op, g)
                return
            chunks = list(flat.tensor_split(g.size))
            reduce_scatter_ring(chunks, op, g)
            finish(chunks[g.rank], op, g.size)  # AVG: divide the one chunk we own, before sharing
            ring_all_gather_(chunks, g)

    return issue("all_reduce", group, async_op, body, nbytes(tensor))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.reduce_scatter: output <- op over all ranks of their input_list[rank]."""
    check_op(op)

    def body(g: GroupView):
        chunks = [t.reshape(-1).clone() for t in input_list]   # private copies: the ring reduces in place
        reduce_scatter_ring(chunks, op, g)
        output.copy_(finish(chunks[g.rank], op, g.size).view_as(output))

    return issue("reduce_scatter", group, async_op, body, nbytes(output) * len(input_list))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.reduce_scatter_tensor: `input` is n equal blocks along dim 0 (FSDP's form),
    reduce-scattered as `reduce_scatter`'s list."""
    return reduce_scatter(output, list(input.reshape(-1).split(output.numel())), op, group, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """torch.distributed.all_gather: tensor_list[i] <- rank i's `tensor`, on every rank."""

    def body(g: GroupView):
        tensor_list[g.rank].copy_(tensor)
        ring_all_gather_(list(tensor_list), g)

    return issue("all_gather", group, async_op, body, nbytes(tensor) * len(tensor_list))


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """torch.distributed.all_gather_into_tensor: rank i's input becomes block i of the output
    (`all_gather` into the output's blocks)."""
    with _flat(output_tensor) as flat:
        return all_gather(list(flat.split(input_tensor.numel())), input_tensor.reshape(-1), group, async_op)
