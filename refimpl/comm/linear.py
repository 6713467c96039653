"""Scatter and gather, the root talking to every other rank directly."""
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
