"""Scatter and gather, the root talking to every other rank directly.

Scatter hands rank i the i-th piece of the root's list; gather is its mirror image, the root
receiving piece i from rank i. The root posts all n-1 sends (or receives) at once and lets them
proceed together, so the time is bounded by the root's own link: (n-1)/n of the whole data must
leave (or enter) the root whichever algorithm is used. MPICH uses a binomial tree for short
messages to cut the log-many startup costs (Thakur, Rabenseifner & Gropp 2005, section 4.3); for the
small tensors a scatter or gather carries in training the direct form is as fast and easier to see.
"""
from __future__ import annotations

import torch.distributed as dist

from refimpl.comm.p2p import GroupView, exchange, nbytes
from refimpl.comm.work import issue


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """torch.distributed.scatter: `tensor` <- the root's scatter_list[rank]."""

    def body(g: GroupView):
        root = g.group_rank(src, group_src, default=0)
        if g.rank != root:
            exchange(g, recvs=[(tensor, root)])
            return
        if scatter_list is None or len(scatter_list) != g.size:
            raise ValueError(f"the root needs a scatter_list of {g.size} tensors")
        exchange(g, sends=[(scatter_list[i], i) for i in range(g.size) if i != root])
        tensor.copy_(scatter_list[root])

    return issue("scatter", group, async_op, body, nbytes(tensor) * dist.get_world_size(group))


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """torch.distributed.gather: the root's gather_list[i] <- rank i's `tensor`."""

    def body(g: GroupView):
        root = g.group_rank(dst, group_dst, default=0)
        if g.rank != root:
            exchange(g, sends=[(tensor, root)])
            return
        if gather_list is None or len(gather_list) != g.size:
            raise ValueError(f"the root needs a gather_list of {g.size} tensors")
        exchange(g, recvs=[(gather_list[i], i) for i in range(g.size) if i != root])
        gather_list[root].copy_(tensor)

    return issue("gather", group, async_op, body, nbytes(tensor) * dist.get_world_size(group))
