"""The pipeline's links: who sends what to whom, and when each send and receive is posted.

refimpl.parallel.pp.runner drives the schedule; this holds its messages. A message's tag names
(kind, micro-batch, piece); piece k lives on rank_of(k). Three ways to post (the runner's docstring
says why; `posting` chooses by backend): on gloo every receive of the step at its start; elsewhere
(NCCL, the staged backend) every send and receive one at a time in the step's one global order
(`Links.post_through`, refimpl.parallel.pp.nccl_order); under REFIMPL_PP_POST=ahead, receives one
entry ahead in each sender's order.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from refimpl.comm import p2p
from refimpl.labels import comm_span
from refimpl.parallel.pp.schedules import Action, piece_of, rank_of

ACTIVATION, GRADIENT = 0, 1


class Links:
    """Who sends what to whom: piece k lives on group rank rank_of(k) (k % p, or on a V); receives
    are posted in each sender's order when the inbox is known (the module docstring)."""

    def __init__(self, group, n_chunks: int, micro_batches: int, like: torch.Tensor | None = None,
                 where: str = "loop", inbox: dict | None = None, shape=None, order: list | None = None):
        self.group = group
        # Received activations and gradients take the residual stream's dtype and device: those
        # of the parameters (fp32; the compute dtype when ZeRO-3/FSDP gathers them in bf16; the
        # rank's GPU under NCCL).
        self.like = {} if like is None else {"dtype": like.dtype, "device": like.device}
        self.p = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.pieces, self.m = self.p * n_chunks, micro_batches
        self.sends: list = []                # (work, tensor): kept alive until the step ends
        self.posted: dict[int, tuple] = {}   # tag -> (work or None, buffer)
        self.local: dict[int, torch.Tensor] = {}   # messages to a piece on this same rank
        self.where, self.shape, self.taken = where, shape, set()
        kinds = {"F": ACTIVATION, "B": GRADIENT}
        self.inbox = None if inbox is None else {   # sender -> tags still to post, in its order
            src: [self.tag(kinds[kind], mb, piece) for kind, mb, piece in order] for src, order in inbox.items()}
        # NCCL: every send and receive posted one at a time in the step's one order
        # (nccl_order.rank_order), each after all earlier ones: (is_send, peer, tag)
        self.order = None if order is None else [
            (kind == "send", peer, self.tag(kinds[k], mb, piece)) for kind, peer, (k, mb, piece) in order]
        self.next_op, self.ready = 0, {}    # position in order; tag -> a send's tensor, not yet posted
        self.done_ops: set = set()

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def piece(self, a: Action) -> int:
        return piece_of(self.rank, a.chunk, self.p, self.where)

    def tag(self, kind: int, mb: int, piece: int) -> int:
        return 1 + (kind * self.pieces + piece) * self.m + mb

    def incoming(self, a: Action):
        """(tag, source rank) of the message action `a` needs, or None (first F, last B, any W)."""
        k = self.piece(a)
        if a.kind == "F" and k > 0:
            return self.tag(ACTIVATION, a.micro_batch, k), rank_of(k - 1, self.p, self.where)
        if a.kind == "B" and k < self.pieces - 1:
            return self.tag(GRADIENT, a.micro_batch, k), rank_of(k + 1, self.p, self.where)
        return None

    def post_through(self, is_send: bool, tag: int) -> None:
        """Ordered mode: post this rank's operations in the step's order up to and including the
        send or receive `tag` (a send whose tensor is not ready yet would break the order)."""
        while (is_send, tag) not in self.done_ops:
            send, peer, t = self.order[self.next_op]
            self.next_op += 1
            if (send, t) in self.done_ops:      # posted ahead of the order (`post_ahead`)
                continue
            self.done_ops.add((send, t))
            if send:
                if t not in self.ready:
                    raise RuntimeError(f"pipeline p2p order: send {t} must go before {tag}, but its "
                                       "action has not run (nccl_order.global_order)")
                tensor = self.ready.pop(t)
                self.sends.append((p2p.isend(tensor, group=self.group, tag=t, group_dst=peer), tensor))
            else:
                self._irecv(t, peer)

    def _irecv(self, tag: int, src: int) -> None:
        """Post the receive of message `tag` from group rank `src` into a fresh buffer."""
        buf = torch.empty(self.shape((tag - 1) % self.m), **self.like)
        self.posted[tag] = (p2p.irecv(buf, group=self.group, tag=tag, group_src=src), buf)

    def post_recv(self, a: Action) -> None:
        if self.order is not None:      # ordered mode posts a receive when it is next in order
            return
        need = self.incoming(a)
        if need is None or need[0] in self.posted or need[0] in self.taken or need[1] == self.rank:
            return
        tag, src = need
        queue = self.inbox.get(src, []) if self.inbox is not None else [tag]
        while tag not in self.posted:       # the sender's earlier messages first: its order
            first = queue.pop(0)
            self._irecv(first, src)

    def post_ahead(self, a: Action) -> None:
        """Post the receive `a` needs now, ahead of every operation the order puts before it: the
        bug of a hand-written schedule (refimpl.faults' p2p-misordered). Under either posting the
        rank then waits for a message its peer sends only after messages this rank has not sent:
        a hang on gloo and on NCCL alike. Only the ordered posting needs it: the other posts a
        receive, with the sender's earlier ones, when `take` asks for it."""
        if self.order is None:
            return
        tag, src = self.incoming(a)
        self._irecv(tag, src)
        self.done_ops.add((False, tag))

    def take(self, a: Action) -> torch.Tensor:
        tag, src = self.incoming(a)
        if src == self.rank:
            return self.local.pop(tag)
        if self.order is not None:
            self.post_through(False, tag)
        self.post_recv(a)
        work, buf = self.posted.pop(tag)
        self.taken.add(tag)
        with comm_span("recv-wait", buf.numel() * buf.element_size(), group=self.group,
                       peer=self.global_rank(src), tag=tag,
                       phase=f"pp:{a.text(self.pieces > self.p)}"):
            work.wait()   # the only place a rank waits for another: the pipeline's bubble
        return buf

    def send(self, tensor: torch.Tensor, kind: int, mb: int, to_piece: int) -> None:
        tag, dst = self.tag(kind, mb, to_piece), rank_of(to_piece, self.p, self.where)
        if dst == self.rank:
            self.local[tag] = tensor
            return
        tensor = tensor.contiguous()
        if self.order is not None:
            self.ready[tag] = tensor
            self.post_through(True, tag)
            return
        self.sends.append((p2p.isend(tensor, group=self.group, tag=tag, group_dst=dst), tensor))

    def finish(self) -> None:
        if self.order is not None and self.next_op != len(self.order):
            raise RuntimeError(f"pipeline p2p order: {len(self.order) - self.next_op} operations never posted")
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()



def posting(group) -> str:
    """How this rank posts the step's sends and receives on `group`: the one choice per backend,
    made here and not by the runner's callers (a caller that forgot to ask for the ordered
    posting hung every schedule under NCCL: issue 35).

      "whole-step"  gloo: every receive of the step before its first action. On gloo, posting a
                    receive takes the link's lock, which a send in flight on the same link holds:
                    in the middle of a step one post measured 4.6 ms (a `comm:irecv` span in a zbv
                    trace; scripts/bench_bubble.py), paid by the rank before its next action, a
                    bubble no schedule has. At the step's start the links are idle and a post
                    costs microseconds. The buffers then exist for the whole step: one [b, s, d]
                    tensor per incoming message, m per neighbour and direction, against the
                    activations a stage keeps (many such tensors per layer per micro-batch in flight).
      "ordered"     any other backend (NCCL, the staged backend that stands in for it): every send
                    and receive posted one at a time in the step's global order
                    (nccl_order.rank_order), the only posting of the three NCCL cannot hang.
      "ahead"       REFIMPL_PP_POST=ahead (`posts_ahead`), on any backend: the old plan, receives one
                    entry ahead: on gloo the bubble before whole-step (scripts/bench_bubble.py
                    --post ahead), under the staged backend the hang NCCL's order gives it
                    (tests/test_nccl_rules.py).
      "local"       no group (one stage): every message stays on the rank."""
    if group is None:
        return "local"
    if posts_ahead():
        return "ahead"
    return "whole-step" if dist.get_backend(group) == "gloo" else "ordered"


def posts_ahead() -> bool:
    """REFIMPL_PP_POST=ahead: post each entry's receives one entry ahead (the runner's first plan)."""
    return os.environ.get("REFIMPL_PP_POST") == "ahead"
