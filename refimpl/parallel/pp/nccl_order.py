"""Point-to-point posting under NCCL's rules: which order of posts can hang, and one that cannot.

gloo runs every posted send and receive on its own, so any order of posts that waits only for
data finishes (the runner's docstring). NCCL does not (NVIDIA/nccl#479, #783): the operations a
rank posts to a peer run one after another on a stream, in posting order, and a send may wait
until the peer's matching receive has started (the k-th send from a to b is paired with b's k-th
receive from a, tags ignored). A receive posted early therefore holds back every later operation
of its stream. In 1F1B on two stages, stage 0 posts B0's receive before F1's send; stage 1 waits
in F1's receive for that send before it sends B0's gradient: each stream's head waits for the
other's second operation, and nothing moves (`ahead_plan`, the runner's order before).

What cannot hang: one global order of the step's messages, the time each is produced in the
table's replay, with every rank posting its part of it one operation at a time (`global_order`,
whose docstring has the argument; `ordered_plan`). Megatron and torch.distributed.pipelining post
one action's sends with the next action's receives as one group (batch_isend_irecv) instead; for
tables in which a rank must receive a peer's messages in another order than it needs them (the V
schedules) that needs more care than a group per action.

Plans are pure functions of the table, and the runner posts `rank_order` exactly (runner's
`links.Links.post_through`), so what `replay` checks is what runs. A plan is a list of events,
("post", ops) or ("wait", ops); an op is (kind "send" | "recv", peer rank, message), a message
(kind, micro-batch, piece) as simulate.messages names it.
"""
from __future__ import annotations

from refimpl.parallel.pp.schedules import Action, parse_entry, piece_of, rank_of
from refimpl.parallel.pp.simulate import inbox as table_inbox
from refimpl.parallel.pp.simulate import simulate


def _produced(a, rank: int, p: int, n_pieces: int, where: str):
    """The message action `a` sends to another rank: (peer, message), or None."""
    k = piece_of(rank, a.chunk, p, where)
    to = {"F": k + 1 if k < n_pieces - 1 else None, "B": k - 1 if k > 0 else None}.get(a.kind)
    if to is None or rank_of(to, p, where) == rank:
        return None
    return rank_of(to, p, where), (a.kind, a.micro_batch, to)


def _needed(a, rank: int, p: int, n_pieces: int, where: str):
    """The message action `a` receives from another rank: (peer, message), or None."""
    k = piece_of(rank, a.chunk, p, where)
    if (a.kind == "F" and k == 0) or (a.kind == "B" and k == n_pieces - 1) or a.kind == "W":
        return None
    src = rank_of(k - 1 if a.kind == "F" else k + 1, p, where)
    return None if src == rank else (src, (a.kind, a.micro_batch, k))


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


def global_order(table, where: str = "loop") -> list[tuple[int, int, tuple]]:
    """Every message of a step as (sender, receiver, message), in the order of the time its sender
    produces it in the table's replay (unit costs; ties by sender, then row position). Each rank
    posting its sends and receives in this order, one at a time, cannot hang under NCCL's rules:
    the earliest message not yet through has both ends at the head of their streams -- its sender
    has produced it (every input of the producing action is an earlier message) and its receiver
    has posted it (a rank posts, in this order, everything before what it waits for; a send it
    must post first is earlier, so produced by an earlier action of its own). jbachan's argument
    on NVIDIA/nccl#784: point-to-point in one global order is as safe as collectives in one order."""
    slots = simulate(table, F=1.0, B=1.0, W=1.0, where=where)
    p = len(table)
    n_pieces = p * (1 + max(a.chunk for row in table for e in row for a in parse_entry(e)))
    position = {(s.rank, s.action): i for i, s in enumerate(slots)}
    out = []
    for s in slots:
        a = Action.parse(s.action)
        made = _produced(a, s.rank, p, n_pieces, where)
        if made is not None:
            out.append(((s.end, s.rank, position[(s.rank, s.action)]), (s.rank, made[0], made[1])))
    return [m for _, m in sorted(out)]


def rank_order(table, rank: int, where: str = "loop") -> list[tuple]:
    """This rank's operations in `global_order`: ("send", receiver, message) or ("recv", sender,
    message). What the runner posts, one at a time, under NCCL (refimpl.parallel.pp.links)."""
    return [("send", dst, m) if src == rank else ("recv", src, m)
            for src, dst, m in global_order(table, where) if rank in (src, dst)]


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
    p = len(table)
    n_pieces = p * (1 + max(a.chunk for row in table for e in row for a in parse_entry(e)))
    if how is None:
        order = global_order(table, where)
        return [ordered_plan(row, r, p, n_pieces, where, order) for r, row in enumerate(table)]
    return [how(row, r, p, n_pieces, where, table_inbox(table, r, where)) for r, row in enumerate(table)]


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
