"""Ring reduce-scatter, ring all-gather, and ring all-reduce = the two of them back to back
(seed 000 §2.1-2.3). Each of n ranks sends (n-1)/n·M per phase: 2(n-1)/n·M for the all-reduce.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed import ReduceOp

from refimpl.comm.halving_doubling import halving_doubling_all_reduce_
from refimpl.comm.p2p import GroupView, exchange, nbytes, post
from refimpl.comm.reduce_ops import check_op, finish, reduce_into
from refimpl.comm.tree import tree_all_reduce_
from refimpl.comm.work import issue


@contextmanager
def _flat(tensor: torch.Tensor):
    """A 1-D contiguous view to run the ring on, written back if `tensor` was not contiguous."""
    if tensor.is_contiguous():
        yield tensor.view(-1)
    else:
        tmp = tensor.contiguous()
        yield tmp.view(-1)
        tensor.copy_(tmp)


# A reduce-scatter step's incoming partial sums arrive in segments of at most SEGMENT_BYTES, into
# two buffers that take turns (segment j is added while j+1 arrives), kept from call to call as
# NCCL keeps its channels' buffers (docs/core_notes.md, refimpl.comm.ring: why 4 MiB, why kept).
SEGMENT_BYTES = 4 << 20
_SEGMENT_BUFFERS: dict = {}


def segment_buffers(numel: int, dtype, device) -> list[torch.Tensor]:
    """The two segment buffers for (dtype, device), grown to `numel` elements when needed."""
    kept = _SEGMENT_BUFFERS.get((dtype, device))
    if kept is None or kept[0].numel() < numel:
        kept = _SEGMENT_BUFFERS[(dtype, device)] = [torch.empty(numel, dtype=dtype, device=device)
                                                     for _ in range(2)]
    return kept


def ring_reduce_scatter_(chunks: list[torch.Tensor], op, g: GroupView) -> None:
    """In place on `chunks` (one per rank): afterwards chunks[g.rank] is the reduction of all."""
    n, r = g.size, g.rank
    right, left = (r + 1) % n, (r - 1) % n
    largest = max(c.numel() for c in chunks)
    n_segments = max(1, -(-largest * chunks[0].element_size() // SEGMENT_BYTES))
    segment = -(-largest // n_segments)
    buffers = segment_buffers(segment, chunks[0].dtype, chunks[0].device)
    for s in range(n - 1):
        outgoing = chunks[(r - s - 1) % n].reshape(-1).tensor_split(n_segments)
        mine = chunks[(r - s - 2) % n].reshape(-1).tensor_split(n_segments)
        incoming = [buffers[j % 2][:mine[j].numel()] for j in range(n_segments)]

        def segment_pair(j: int):
            # Segment j's send and receive as one group. Under NCCL's order (a rank's operations
            # run in posting order; a send completes only once its receive has started) sends
            # posted before the receives would hang every ring: each rank's first send waits for
            # a receive its neighbour posted behind its own sends (refimpl.lab.runtime.staged_stream).
            return post(g, sends=[(outgoing[j], right)], recvs=[(incoming[j], left)])

        arriving = segment_pair(0)
        for j in range(n_segments):
            following = segment_pair(j + 1) if j + 1 < n_segments else None
            arriving.wait()
            reduce_into(mine[j], incoming[j], op)
            arriving = following


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
            ring_reduce_scatter_(chunks, op, g)
            finish(chunks[g.rank], op, g.size)  # AVG: divide the one chunk we own, before sharing
            ring_all_gather_(chunks, g)

    return issue("all_reduce", group, async_op, body, nbytes(tensor))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.reduce_scatter: output <- op over all ranks of their input_list[rank]."""
    check_op(op)

    def body(g: GroupView):
        n, r = g.size, g.rank
        right, left = (r + 1) % n, (r - 1) % n
        buffers = (torch.empty_like(output), torch.empty_like(output))
        acc = input_list[(r - 1) % n]  # step 0 forwards our own contribution to chunk r-1
        for s in range(n - 1):
            incoming = buffers[s % 2]
            exchange(g, sends=[(acc, right)], recvs=[(incoming, left)])
            acc = reduce_into(incoming, input_list[(r - s - 2) % n], op)
        output.copy_(acc)
        finish(output, op, n)

    return issue("reduce_scatter", group, async_op, body, nbytes(output) * len(input_list))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.reduce_scatter_tensor: `input` is n equal blocks along dim 0 (FSDP's form)."""
    check_op(op)

    def body(g: GroupView):
        with _flat(input.clone()) as flat:  # a private copy: the ring reduces in place
            chunks = list(flat.chunk(g.size))
            ring_reduce_scatter_(chunks, op, g)
            output.copy_(finish(chunks[g.rank], op, g.size).view_as(output))

    return issue("reduce_scatter", group, async_op, body, nbytes(input))


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """torch.distributed.all_gather: tensor_list[i] <- rank i's `tensor`, on every rank."""

    def body(g: GroupView):
        tensor_list[g.rank].copy_(tensor)
        ring_all_gather_(list(tensor_list), g)

    return issue("all_gather", group, async_op, body, nbytes(tensor) * len(tensor_list))


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """torch.distributed.all_gather_into_tensor: rank i's input becomes block i of the output."""

    def body(g: GroupView):
        with _flat(output_tensor) as flat:
            chunks = list(flat.chunk(g.size))
            chunks[g.rank].copy_(input_tensor.reshape(-1))
            ring_all_gather_(chunks, g)

    return issue("all_gather", group, async_op, body, nbytes(output_tensor))
