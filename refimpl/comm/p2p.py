"""The only communication every other file in `refimpl.comm` is allowed to use: send and receive."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from refimpl.seam import message

# Collectives send with their own tag so that a pipeline stage's user-level send/recv (tag 0)
# between the same two ranks can never be matched with a message that belongs to a ring.
COLLECTIVE_TAG = 0x636F  # "co"


@dataclass(frozen=True)
class GroupView:
    """This rank as a member of `group`: its index (`rank`) and the group's `size`."""

    group: object  # a ProcessGroup, or None for the default (world) group
    rank: int
    size: int

    @classmethod
    def of(cls, group=None) -> "GroupView":
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    @property
    def member(self) -> bool:
        """torch returns -1 from get_rank for a rank outside the group; it then skips the call."""
        return self.rank >= 0

    def group_rank(self, global_rank: int | None, group_rank: int | None, default: int | None = None) -> int:
        """torch's convention: a root is given either as a global rank or as a group rank."""
        if global_rank is not None and group_rank is not None:
            raise ValueError("give either a global rank or a group rank, not both")
        if global_rank is None:
            if group_rank is None and default is None:
                raise ValueError("a root rank is required")
            return default if group_rank is None else group_rank
        return global_rank if self.group is None else dist.get_group_rank(self.group, global_rank)


class Posted:
    """Messages in flight; `wait()` returns once every one of them has completed."""

    def __init__(self, works, copy_back):
        self._works, self._copy_back = works, copy_back

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        for tensor, buf in self._copy_back:
            tensor.copy_(buf)


def post(g: GroupView, sends=(), recvs=()) -> Posted:
    """Start sending each (tensor, peer) and receiving into each (tensor, peer); do not wait."""
    ops, copy_back = [], []      # ("recv" or "send", buffer, peer)
    for tensor, peer in recvs:
        if tensor.numel() == 0:
            continue
        buf = tensor
        if not tensor.is_contiguous():
            buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            copy_back.append((tensor, buf))
        ops.append(("recv", buf, peer))
        message("received", buf.numel() * buf.element_size())
    for tensor, peer in sends:
        if tensor.numel() == 0:
            continue
        buf = tensor.contiguous()
        ops.append(("send", buf, peer))
        message("sent", buf.numel() * buf.element_size())
    tag = COLLECTIVE_TAG
    backend = dist.get_backend(g.group) if ops else None
    if backend in ("nccl", "staged"):
        # One group (batch_isend_irecv): a receive and a send to the same peer, posted one by one,
        # could wait for each other (docs/core_notes.md, refimpl.comm.p2p)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.irecv if kind == "recv" else dist.isend, buf, group=g.group, group_peer=peer, tag=tag)
            for kind, buf, peer in ops])
    else:   # gloo (and the dry run's fake group) runs each posted operation on its own
        works = [dist.irecv(buf, group=g.group, group_src=peer, tag=tag) if kind == "recv"
                 else dist.isend(buf, group=g.group, group_dst=peer, tag=tag) for kind, buf, peer in ops]
    return Posted(works, copy_back)


def exchange(g: GroupView, sends=(), recvs=()) -> None:
    """`post` the messages and wait for all of them."""
    post(g, sends, recvs).wait()


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
