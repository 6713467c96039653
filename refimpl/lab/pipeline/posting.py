"""The pipeline runner's old posting, kept as a plug-in to reproduce the hang it had under NCCL.

    run_schedule(chunks, table, micro, group, links=AheadLinks)

Before the runner posted every operation in one global order (refimpl.parallel.pp.links), it
posted the receives of each entry and of the next one before running the entry (in each sender's
order), and each send as its action produced it. gloo runs that; under NCCL's stream order (and
the staged backend that keeps it on a CPU) 1F1B hangs: stage 0 posts B0's receive before F1's send
(refimpl.lab.pipeline.nccl_order replays it offline; tests/test_nccl_rules.py runs it). On gloo it
also costs time: a receive posted while a send is in flight on its link waits for that link
(scripts/bench_bubble.py --post ahead).
"""
from __future__ import annotations

import os

from refimpl.lab.pipeline.simulate import inbox
from refimpl.parallel.pp.links import Links
from refimpl.parallel.pp.order import incoming, outgoing
from refimpl.parallel.pp.schedules import parse_entry

ENV = "REFIMPL_PP_POST"     # =ahead: pp_measure's runs (bench_bubble.py --post ahead) use AheadLinks


class AheadLinks(Links):
    def __init__(self, group, table, where, micro_batches, shape, like=None):
        super().__init__(group, table, where, micro_batches, shape, like)
        self.row = [parse_entry(e) for e in table[self.rank]]
        queue = inbox(table, self.rank, where)
        self.queue = {src: list(messages) for src, messages in queue.items()}
        self.entry_of = {}       # (is a send, message) -> the entry of the row that posts it
        for i, entry in enumerate(self.row):
            for a in entry:
                for is_send, found in ((False, incoming), (True, outgoing)):
                    hit = found(a, self.rank, self.p, self.pieces, where)
                    if hit is not None:
                        self.entry_of[(is_send, hit[1])] = i

    def post_through(self, op: tuple) -> None:
        """The receives of this entry and the next, each sender's earlier ones first; then `op`."""
        is_send, _, message = op
        last = self.entry_of[(is_send, message)] + 1
        for entry in self.row[:last + 1]:
            for a in entry:
                need = incoming(a, self.rank, self.p, self.pieces, self.where)
                if need is not None and need[0] != self.rank:
                    self._receive_in_order(*need)
        if is_send:
            self.post(op)

    def _receive_in_order(self, src: int, message: tuple) -> None:
        while (False, src, message) not in self.done:
            self.post((False, src, self.queue[src].pop(0)))


def chosen_links():
    """The Links a run's environment asks for: AheadLinks under REFIMPL_PP_POST=ahead, else None
    (the runner's default)."""
    return AheadLinks if os.environ.get(ENV) == "ahead" else None
