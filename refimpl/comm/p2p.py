"""The only communication every other file in `refimpl.comm` is allowed to use: send and receive.

Two pieces:

* `GroupView` turns `group=None | ProcessGroup` into (this rank's index in the group, the group's
  size), the numbers every algorithm is written in. Peers are always addressed by *group* rank
  (`group_dst=` / `group_src=`), so the same ring runs unchanged on the world or on a tensor- or
  data-parallel subgroup, whose members' global ranks may be 1, 3, 5, 7.
* `post` starts a set of non-blocking receives and sends at once, as one group; `exchange` also
  waits for them.
  Posting both sides before waiting is what keeps a ring from deadlocking: with blocking `send`
  every rank would wait for its right neighbour to call `recv`, which it never does because it is
  itself stuck in `send` (the classic cyclic wait).

`send`, `recv`, `isend`, `irecv` are torch.distributed's own, wrapped only to count bytes, so
pipeline code can use `comm.send` and have its traffic counted like every collective's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refimpl.comm.counter import op_scope, record_recv, record_send
from refimpl.labels import comm_span

# Collectives send with their own tag so that a pipeline stage's user-level send/recv (tag 0)
# between the same two ranks can never be matched with a message that belongs to a ring.
COLLECTIVE_TAG = 0x636F  # "co"


def wire_tag(tag: int) -> int:
    """The tag a message really carries. NCCL ignores tags: between two ranks it pairs messages in
    the order they were posted. gloo pairs them by tag, which can hide a posting order that NCCL
    would pair wrongly (the wrong tensor, silently, when shapes agree) or not at all (a hang).
    REFIMPL_P2P_TAGS=one sends every message with tag 0, so gloo pairs them as NCCL does: the test
    mode in which every schedule, ring and rebuilt collective must still equal single
    (tests/test_nccl_rules.py)."""
    return 0 if os.environ.get("REFIMPL_P2P_TAGS") == "one" else tag


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
        if group_rank is not None:
            return group_rank
        if global_rank is None:
            if default is None:
                raise ValueError("a root rank is required")
            return default
        if self.group is None:
            return global_rank
        return dist.get_group_rank(self.group, global_rank)


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
    """Start sending each (tensor, peer) and receiving into each (tensor, peer); do not wait.

    Peers are group ranks. Empty tensors are skipped on both sides: each side computes the same
    sizes, so a message of zero elements is simply never posted. A receive buffer that is not
    contiguous (a column slice, say) is filled through a contiguous staging copy.
    Between two ranks, messages with the same tag are matched in the order they were posted, which
    is what lets a pipelined ring post a chunk's segments one after another.
    """
    ops, copy_back = [], []      # ("recv" or "send", buffer, peer)
    for tensor, peer in recvs:
        if tensor.numel() == 0:
            continue
        buf = tensor
        if not tensor.is_contiguous():
            buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            copy_back.append((tensor, buf))
        ops.append(("recv", buf, peer))
        record_recv(buf.numel() * buf.element_size())
    for tensor, peer in sends:
        if tensor.numel() == 0:
            continue
        buf = tensor.contiguous()
        ops.append(("send", buf, peer))
        record_send(buf.numel() * buf.element_size())
    tag = wire_tag(COLLECTIVE_TAG)
    backend = dist.get_backend(g.group) if ops else None
    if backend in ("nccl", "staged"):
        # One group (batch_isend_irecv): NCCL runs the operations between two ranks in posting
        # order and a send may wait for its receive, so a receive and a send to the same peer
        # posted one by one would wait for each other (a 2-rank ring, every pairwise exchange);
        # in a group they start together (refimpl.parallel.pp.nccl_order has the rule). The
        # staged backend keeps that rule (refimpl.staged_stream runs the batch as one group).
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


def _global(rank: int | None, group, group_rank: int | None) -> int | None:
    """The peer's global rank, whichever way the caller named it (for the flight recorder)."""
    if rank is not None or group_rank is None or group is None:
        return rank if rank is not None else group_rank
    return dist.get_global_rank(group, group_rank)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# Point-to-point traffic is counted under one name, "p2p", in both `sent` and `received`, and
# labelled comm:send / comm:recv (comm:isend / comm:irecv: posting only) in a trace.
def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    """torch.distributed.send, counted and labelled."""
    with op_scope("p2p"), comm_span("send", nbytes(tensor), group=group,
                                         peer=_global(dst, group, group_dst), tag=tag):
        record_send(nbytes(tensor))
        return dist.send(tensor, dst, group, wire_tag(tag), group_dst=group_dst)


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    """torch.distributed.recv, counted and labelled."""
    with op_scope("p2p"), comm_span("recv", nbytes(tensor), group=group,
                                         peer=_global(src, group, group_src), tag=tag):
        record_recv(nbytes(tensor))
        return dist.recv(tensor, src, group, wire_tag(tag), group_src=group_src)


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    """torch.distributed.isend, counted; the returned handle's wait() is the caller's."""
    with op_scope("p2p"), comm_span("isend", nbytes(tensor), group=group,
                                         peer=_global(dst, group, group_dst), tag=tag):
        record_send(nbytes(tensor))
        return dist.isend(tensor, dst, group, wire_tag(tag), group_dst=group_dst)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    """torch.distributed.irecv, counted; the returned handle's wait() is the caller's."""
    with op_scope("p2p"), comm_span("irecv", nbytes(tensor), group=group,
                                         peer=_global(src, group, group_src), tag=tag):
        record_recv(nbytes(tensor))
        return dist.irecv(tensor, src, group, wire_tag(tag), group_src=group_src)
