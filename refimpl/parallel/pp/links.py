"""The pipeline's links: this rank's sends and receives of one step, posted in the step's one order.

    links = Links(group, table, where, m, shape, like)
    x = links.receive(action)        # the only wait of a rank: the pipeline's bubble
    links.send(action, y)            # an isend: posting it never waits
"""
from __future__ import annotations

import torch

from refimpl.parallel.pp.order import incoming, n_pieces, outgoing, rank_order
from refimpl.parallel.pp.schedules import Action, parse_entry
from refimpl.seam import dist, phase

KINDS = {"F": 0, "B": 1}      # an activation, a gradient


class Links:
    def __init__(self, group, table: list[list[str]], where: str, micro_batches: int, shape,
                 like: torch.Tensor | None = None):
        self.group, self.where, self.m, self.shape = group, where, micro_batches, shape
        self.p = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.like = {} if like is None else {"dtype": like.dtype, "device": like.device}
        self.pieces, self.ops = self.plan(table)
        self.done = set()
        self.posted, self.ready, self.local, self.sends = {}, {}, {}, []

    def plan(self, table: list[list[str]]) -> tuple[int, list]:
        """(pieces, this rank's operations in the step's order)."""
        pieces = n_pieces([[parse_entry(e) for e in row] for row in table])
        return pieces, rank_order(table, self.rank, self.where)

    def tag(self, message: tuple) -> int:
        kind, mb, piece = message
        return 1 + (KINDS[kind] * self.pieces + piece) * self.m + mb

    def receive(self, a: Action) -> torch.Tensor:
        src, message = incoming(a, self.rank, self.p, self.pieces, self.where)
        if src == self.rank:
            return self.local.pop(message)
        self.post_through((False, src, message))
        work, buf = self.posted.pop(message)
        with phase(f"pp:{a.text(self.pieces > self.p)} recv"):
            work.wait()
        return buf

    def send(self, a: Action, tensor: torch.Tensor) -> None:
        dst, message = outgoing(a, self.rank, self.p, self.pieces, self.where)
        if dst == self.rank:
            self.local[message] = tensor
            return
        self.ready[message] = tensor.contiguous()
        self.post_through((True, dst, message))

    def post_through(self, op: tuple) -> None:
        """Post this rank's operations in the step's order, up to and including `op`."""
        while op not in self.done:
            self.post(self.ops[len(self.done)])

    def post(self, op: tuple) -> None:
        is_send, peer, message = op
        self.done.add(op)
        if is_send:
            tensor = self.ready.pop(message)
            work = dist.isend(tensor, group=self.group, tag=self.tag(message), group_dst=peer)
            self.sends.append((work, tensor))
        else:
            buf = torch.empty(self.shape(message[1]), **self.like)
            work = dist.irecv(buf, group=self.group, tag=self.tag(message), group_src=peer)
            self.posted[message] = (work, buf)

    def finish(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
