"""The ring's reduce-scatter in segments, through two buffers kept from call to call: a speed-up on
gloo, installed in place of refimpl.comm.ring's plain steps (entry point "refimpl.ring_reduce_scatter").

The steps and the bytes are the core's; what differs is where the incoming partial sums land. They
arrive in segments of at most SEGMENT_BYTES into two segment-sized buffers that take turns (segment
j is added while j+1 arrives), and the buffers are kept as NCCL keeps its channels' buffers: a
chunk-sized buffer per call is a fresh mmap whose pages fault in on every all-reduce
(docs/core_notes.md, refimpl.comm.ring: why 4 MiB, why kept, the measurements).
"""
from __future__ import annotations

import torch

from refimpl.comm.p2p import GroupView, post
from refimpl.comm.reduce_ops import reduce_into

SEGMENT_BYTES = 4 << 20
_SEGMENT_BUFFERS: dict = {}


def segment_buffers(numel: int, dtype, device) -> list[torch.Tensor]:
    """The two segment buffers for (dtype, device), grown to `numel` elements when needed."""
    kept = _SEGMENT_BUFFERS.get((dtype, device))
    if kept is None or kept[0].numel() < numel:
        kept = _SEGMENT_BUFFERS[(dtype, device)] = [torch.empty(numel, dtype=dtype, device=device)
                                                     for _ in range(2)]
    return kept


def segmented_reduce_scatter_(chunks: list[torch.Tensor], op, g: GroupView) -> None:
    """refimpl.comm.ring.ring_reduce_scatter_, each step's message cut into segments."""
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
