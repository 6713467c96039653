"""A step's messages, and the one order in which every rank posts them.

A message is (kind, micro-batch, piece): the activation an F sends to piece k+1, or the gradient a
B sends to piece k-1, named by the piece that receives it. NCCL pairs the k-th send from a to b with
b's k-th receive from a and may hold a send until its receive starts (NVIDIA/nccl#479): posting
every send and receive one at a time in the order the table produces the messages cannot hang
(jbachan, NVIDIA/nccl#784: point-to-point in one global order is as safe as collectives in one).
"""
from __future__ import annotations

from refimpl.parallel.pp.actions import Action, parse_entry, piece_of, rank_of


class ScheduleError(ValueError):
    """A table that is not a valid pipeline schedule; the message names the first violation."""


def n_pieces(rows) -> int:
    """Pieces (virtual stages) of a table parsed into entries of actions: p times the chunks."""
    return len(rows) * (1 + max((a.chunk for row in rows for e in row for a in e), default=0))


def dependencies(a: Action, rank: int, p: int, pieces: int, where: str = "loop") -> list[tuple]:
    """(kind, micro-batch, piece) of the actions `a` waits for: F the activation, B the gradient
    (or, on the last piece, the loss) and its own F, W its own B."""
    k = piece_of(rank, a.chunk, p, where)
    if a.kind == "F":
        return [("F", a.micro_batch, k - 1)] if k > 0 else []
    if a.kind == "B":
        upstream = ("B", a.micro_batch, k + 1) if k < pieces - 1 else ("F", a.micro_batch, k)
        return [upstream, ("F", a.micro_batch, k)]
    return [("B", a.micro_batch, k)]


def outgoing(a: Action, rank: int, p: int, pieces: int, where: str = "loop"):
    """(receiving rank, message) of what `a` sends, or None (the last F, the first B, any W)."""
    k = piece_of(rank, a.chunk, p, where)
    to = {"F": k + 1 if k < pieces - 1 else None, "B": k - 1 if k > 0 else None}.get(a.kind)
    return None if to is None else (rank_of(to, p, where), (a.kind, a.micro_batch, to))


def incoming(a: Action, rank: int, p: int, pieces: int, where: str = "loop"):
    """(sending rank, message) of what `a` receives, or None (the first F, the last B, any W)."""
    k = piece_of(rank, a.chunk, p, where)
    if (a.kind == "F" and k == 0) or (a.kind == "B" and k == pieces - 1) or a.kind == "W":
        return None
    return rank_of(k - 1 if a.kind == "F" else k + 1, p, where), (a.kind, a.micro_batch, k)


def unit_replay(table, where: str = "loop") -> list[tuple[int, int, Action]]:
    """(end time, rank, action) of every action, each taking one unit and starting as soon as its
    rank is free and what it waits for has ended (a pair "F&B": both inputs, then F, then B), in
    the order the replay reaches them. Raises ScheduleError where every rank would wait forever."""
    rows = [[parse_entry(e) for e in row] for row in table]
    p, pieces = len(rows), n_pieces(rows)
    end, nxt, free, out = {}, [0] * p, [0] * p, []
    while any(nxt[r] < len(rows[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(rows[r]):
                deps = [d for a in rows[r][nxt[r]] for d in dependencies(a, r, p, pieces, where)]
                if any(d not in end for d in deps):
                    break
                t = max([free[r]] + [end[d] for d in deps])
                for a in rows[r][nxt[r]]:
                    t += 1
                    end[(a.kind, a.micro_batch, piece_of(r, a.chunk, p, where))] = t
                    out.append((t, r, a))
                free[r], nxt[r], moved = t, nxt[r] + 1, True
        if not moved:
            stuck = {r: table[r][nxt[r]] for r in range(p) if nxt[r] < len(rows[r])}
            raise ScheduleError(f"deadlock: every rank waits ({stuck})")
    return out


def global_order(table, where: str = "loop") -> list[tuple[int, int, tuple]]:
    """Every message between two ranks as (sender, receiver, message), in the order the replay
    produces them (ties by sender, then the replay's order). The earliest message not yet through
    then always has both ends at the head of their streams: its sender produced it from earlier
    messages, and its receiver posted everything before it."""
    p = len(table)
    pieces = n_pieces([[parse_entry(e) for e in row] for row in table])
    made = []
    for i, (t, r, a) in enumerate(unit_replay(table, where)):
        out = outgoing(a, r, p, pieces, where)
        if out is not None and out[0] != r:
            made.append(((t, r, i), (r, out[0], out[1])))
    return [m for _, m in sorted(made)]


def rank_order(table, rank: int, where: str = "loop") -> list[tuple[bool, int, tuple]]:
    """This rank's part of `global_order`: (is a send, peer rank, message), in posting order."""
    return [(src == rank, dst if src == rank else src, m)
            for src, dst, m in global_order(table, where) if rank in (src, dst)]
