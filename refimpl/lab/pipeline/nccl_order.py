"""Point-to-point posting under NCCL's rules, replayed offline: which order of posts can hang.

gloo runs every posted send and receive on its own. NCCL does not (NVIDIA/nccl#479, #783): the
operations a rank posts to a peer run one after another, in posting order, and a send may wait
until the peer's matching receive has started (the k-th send from a to b pairs with b's k-th
receive from a, tags ignored). A receive posted early then holds back every later operation of its
stream. In 1F1B on two stages, stage 0 posting B0's receive before F1's send while stage 1 waits
in F1's receive before sending B0's gradient hangs (`ahead_plan`, the runner's order before,
refimpl.lab.pipeline.posting.AheadLinks). What the runner posts instead, one operation at a time
in one global order (refimpl.parallel.pp.order.rank_order), cannot (`ordered_plan`).

A plan is a list of events, ("post", ops) or ("wait", ops); an op is (kind "send" | "recv", peer
rank, message), a message (kind, micro-batch, piece) as refimpl.parallel.pp.order names it.
"""
from __future__ import annotations

from refimpl.lab.pipeline.simulate import inbox as table_inbox
from refimpl.parallel.pp.order import global_order, incoming, n_pieces, outgoing, rank_order  # noqa: F401
from refimpl.parallel.pp.schedules import parse_entry


def _produced(a, rank: int, p: int, n_pieces: int, where: str):
    """The message action `a` sends to another rank: (peer, message), or None."""
    out = outgoing(a, rank, p, n_pieces, where)
    return None if out is None or out[0] == rank else out


def _needed(a, rank: int, p: int, n_pieces: int, where: str):
    """The message action `a` receives from another rank: (peer, message), or None."""
    need = incoming(a, rank, p, n_pieces, where)
    return None if need is None or need[0] == rank else need


class _Receives:
    """Receives in each sender's order: to post message x from a sender, first post every message
    that sender sends before x (the pairing is by order, not by tag)."""

    def __init__(self, inbox: dict[int, list]):
        self.queue = {src: list(order) for src, order in inbox.items()}
        self.posted: set = set()

    def up_to(self, src: int, message) -> list:
        ops = []
        while message not in self.posted:
            first = self.queue[src].pop(0)
            self.posted.add(first)
            ops.append(("recv", src, first))
        return ops


def ahead_plan(row: list[str], rank: int, p: int, n_pieces: int, where: str, inbox: dict[int, list]) -> list:
    """One operation at a time: the receives of this entry and the next posted before it, each
    send posted as its action ends (the runner's order before the global order)."""
    receives, plan, entries = _Receives(inbox), [], [parse_entry(e) for e in row]
    for i, entry in enumerate(entries):
        for a in (b for e in entries[i:i + 2] for b in e):
            need = _needed(a, rank, p, n_pieces, where)
            if need is not None:
                plan += [("post", [op]) for op in receives.up_to(*need)]
        for a in entry:
            need = _needed(a, rank, p, n_pieces, where)
            if need is not None:
                plan.append(("wait", [("recv", *need)]))
            out = _produced(a, rank, p, n_pieces, where)
            if out is not None:
                plan.append(("post", [("send", *out)]))
    return plan


def ordered_plan(row: list[str], rank: int, p: int, n_pieces: int, where: str, order: list) -> list:
    """One operation at a time, this rank's part of `global_order`: before waiting for a receive,
    and when a send's tensor is ready, every earlier operation of this rank is posted first."""
    mine = [("send", dst, m) if src == rank else ("recv", src, m) for src, dst, m in order if rank in (src, dst)]
    plan, next_op = [], 0

    def post_up_to(op):
        nonlocal next_op
        while op not in mine[:next_op]:
            plan.append(("post", [mine[next_op]]))
            next_op += 1

    for entry in map(parse_entry, row):
        for a in entry:
            need = _needed(a, rank, p, n_pieces, where)
            if need is not None:
                post_up_to(("recv", *need))
                plan.append(("wait", [("recv", *need)]))
            out = _produced(a, rank, p, n_pieces, where)
            if out is not None:
                post_up_to(("send", *out))
    return plan


def plans(table, where: str = "loop", how=None) -> list[list]:
    """Every rank's plan for `table` (refimpl.parallel.pp.schedules.schedule_table): `ordered_plan`,
    or `how` (ahead_plan)."""
    p, pieces = len(table), n_pieces([[parse_entry(e) for e in row] for row in table])
    if how is None:
        order = global_order(table, where)
        return [ordered_plan(row, r, p, pieces, where, order) for r, row in enumerate(table)]
    return [how(row, r, p, pieces, where, table_inbox(table, r, where)) for r, row in enumerate(table)]


def replay(plans_per_rank: list[list], one_stream: bool = True) -> str | None:
    """Run the plans under NCCL's rules; None if every rank finishes, else who is stuck where.

    A rank's host walks its plan: a post puts the operation on a stream and goes on; a wait blocks
    until the receive has completed. An operation runs once it is the first unfinished one of its
    stream (`one_stream`: one stream per rank, the strictest reading; else one per peer, as PyTorch
    gives each pair of ranks its own communicator for single sends and receives), and it completes
    when its partner -- the k-th send a->b for b's k-th receive from a -- is running too."""
    n = len(plans_per_rank)
    queues = [{} for _ in range(n)]     # stream key -> this rank's posted operations not yet through
    pairing, posted = {}, {}            # (rank, op) -> (sender, receiver, k); (sender, receiver, kind) -> k
    done, at = set(), [0] * n
    while True:
        moved = False
        for r in range(n):                            # hosts
            while at[r] < len(plans_per_rank[r]):
                event, ops = plans_per_rank[r][at[r]]
                if event == "wait" and not all((r, op) in done for op in ops):
                    break
                for op in ops if event == "post" else ():
                    kind, peer, _ = op
                    link = (r, peer) if kind == "send" else (peer, r)
                    k = posted[link + (kind,)] = posted.get(link + (kind,), 0) + 1
                    pairing[(r, op)] = link + (k,)
                    queues[r].setdefault("all" if one_stream else peer, []).append(op)
                at[r] += 1
                moved = True
        heads = {pairing[(r, q[0])] + (q[0][0],): (r, key) for r in range(n)
                 for key, q in queues[r].items() if q}
        for (*link, kind), (r, key) in heads.items():     # devices
            if tuple(link) + ("recv" if kind == "send" else "send",) in heads:
                done.add((r, queues[r][key].pop(0)))
                moved = True
        if all(at[r] == len(plans_per_rank[r]) and not any(queues[r].values()) for r in range(n)):
            return None
        if not moved:
            stuck = {r: plans_per_rank[r][at[r]] if at[r] < len(plans_per_rank[r]) else "streams"
                     for r in range(n) if at[r] < len(plans_per_rank[r]) or any(queues[r].values())}
            return f"deadlock under NCCL's order: {stuck}"
