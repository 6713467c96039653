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


# The incoming partial sums of one reduce-scatter step arrive in segments of at most this many
# bytes, into two segment-sized buffers that take turns: while segment j is being added into our
# chunk, segment j+1 is already arriving. The point is less the overlap than the memory: a scratch
# buffer as large as a whole chunk (32 MB of a 64 MB all-reduce on 2 ranks) is a fresh mmap on every
# call (glibc maps blocks that large anew each time), and faulting its pages in cost more than the
# transfer (measured on 2 ranks, 64 MB: 96 ms with a fresh chunk-sized buffer, 65 ms without).
#
# Why not gloo's 1 MB segments (gloo/allreduce.h, kMaxSegmentSize, two in flight)? Measured with
# 16 MB on 4 ranks sharing 2 cores (perf record over 400 calls, each side alone): where the ranks
# outnumber the cores, the time is CPU time, and most of it is the kernel copying bytes into and out
# of the sockets. With our 4 MB messages those copies cost 1.5x (receive) and 1.25x (send) what
# gloo's cost, and our additions 1.33x gloo's: the data has left the cores' 2 MB caches before it
# is copied again. Cut to gloo's 1 MB, the copies cost what gloo's do (1.13x, 1.02x), but every
# extra message costs ~90 us of CPU in Python and the c10d calls (post, wait: 18 more per call),
# and a call got no faster (32.3 ms against 31.4 ms; gloo 27.8 ms). The same messages in the
# same order, posted by bare ProcessGroup send/recv calls without this package's wrappers (labels,
# byte counts, NCCL's grouping), reached 0.92-1.02 of gloo's bus bandwidth in runs where this ring
# reached 0.85-0.93: at 4 ranks on 2 cores the gap to gloo (0.83-0.88 in `make bench`) is in the
# work around each message, not in the ring's order. Which part of that work costs it the runs did
# not separate from their noise (+-0.04 run to run): issue() is ~20 us a call, post() ~30 us a
# message. With a core per rank (2 ranks here) the ring is >= 0.9 of gloo.
SEGMENT_BYTES = 4 << 20


def ring_reduce_scatter_(chunks: list[torch.Tensor], op, g: GroupView) -> None:
    """In place on `chunks` (one per rank): afterwards chunks[g.rank] is the reduction of all."""
    n, r = g.size, g.rank
    right, left = (r + 1) % n, (r - 1) % n
    largest = max(c.numel() for c in chunks)
    n_segments = max(1, -(-largest * chunks[0].element_size() // SEGMENT_BYTES))
    segment = -(-largest // n_segments)
    buffers = [torch.empty(segment, dtype=chunks[0].dtype, device=chunks[0].device)
               for _ in range(min(2, n_segments))]
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


ALGORITHMS = ("ring", "halving-doubling")


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, algorithm="ring"):
    """torch.distributed.all_reduce, in place: on a ring (reduce-scatter, then all-gather), or with
    `algorithm="halving-doubling"` by recursive halving and doubling (halving_doubling.py)."""
    check_op(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all_reduce algorithm must be one of {ALGORITHMS}, not {algorithm!r}")

    def body(g: GroupView):
        with _flat(tensor) as flat:
            if algorithm == "halving-doubling":
                halving_doubling_all_reduce_(flat, op, g)
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
