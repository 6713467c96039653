"""The one order in which every rank posts a step's messages (NCCL needs it: NVIDIA/nccl#479, #784).

A message is (kind, micro-batch, piece): what an F sends to piece k+1 or a B to piece k-1, named by
the piece that receives it. Every rank posts its sends and receives in the order a unit-time replay
of the table produces the messages, so the k-th send from a to b meets b's k-th receive from a.
"""
from __future__ import annotations

from refimpl.parallel.pp.schedules import Action, parse_entry, piece_of, rank_of

STEP = {"F": 1, "B": -1}      # F's message goes down the pieces, B's back up; W sends nothing


class ScheduleError(ValueError):
    """A table that is not a valid pipeline schedule."""


def n_pieces(rows) -> int:
    """Pieces (virtual stages) of a parsed table: p times the chunks."""
    return len(rows) * (1 + max((a.chunk for row in rows for e in row for a in e), default=0))


def outgoing(a: Action, rank: int, p: int, pieces: int, where: str = "loop"):
    """(receiving rank, message) of what `a` sends, or None (the last F, the first B, any W)."""
    if a.kind == "W":
        return None
    to = piece_of(rank, a.chunk, p, where) + STEP[a.kind]
    return (rank_of(to, p, where), (a.kind, a.micro_batch, to)) if 0 <= to < pieces else None


def incoming(a: Action, rank: int, p: int, pieces: int, where: str = "loop"):
    """(sending rank, message) of what `a` receives, or None (the first F, the last B, any W)."""
    if a.kind == "W":
        return None
    k = piece_of(rank, a.chunk, p, where)
    src = k - STEP[a.kind]
    return (rank_of(src, p, where), (a.kind, a.micro_batch, k)) if 0 <= src < pieces else None


def dependencies(a: Action, rank: int, p: int, pieces: int, where: str = "loop") -> list[tuple]:
    """(kind, micro-batch, piece) of the actions `a` waits for: F the activation, B the gradient
    (the loss on the last piece) and its own F, W its own B."""
    k = piece_of(rank, a.chunk, p, where)
    if a.kind == "W":
        return [("B", a.micro_batch, k)]
    src = k - STEP[a.kind]
    upstream = [(a.kind, a.micro_batch, src)] if 0 <= src < pieces else []
    return upstream + ([("F", a.micro_batch, k)] if a.kind == "B" else [])


def global_order(table, where: str = "loop") -> list[tuple[int, int, tuple]]:
    """Every message between two ranks as (sender, receiver, message), in the order a replay of the
    table produces them: every action takes one unit and starts once its rank is free and its
    inputs exist (a pair: both inputs); ties by sender, then the replay's order. Raises
    ScheduleError on a deadlock."""
    rows = [[parse_entry(e) for e in row] for row in table]
    p, pieces = len(rows), n_pieces(rows)
    end, nxt, free, made = {}, [0] * p, [0] * p, []
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
                    out = outgoing(a, r, p, pieces, where)
                    if out is not None and out[0] != r:
                        made.append(((t, r, len(made)), (r, *out)))
                free[r], nxt[r], moved = t, nxt[r] + 1, True
        if not moved:
            stuck = {r: table[r][nxt[r]] for r in range(p) if nxt[r] < len(rows[r])}
            raise ScheduleError(f"deadlock: every rank waits ({stuck})")
    return [m for _, m in sorted(made)]


def rank_order(table, rank: int, where: str = "loop") -> list[tuple[bool, int, tuple]]:
    """This rank's part of `global_order`: (is a send, peer rank, message), in posting order."""
    return [(src == rank, dst if src == rank else src, m)
            for src, dst, m in global_order(table, where) if rank in (src, dst)]
