"""The frontier schedules, a plug-in of the core's table (refimpl.parallel.pp.schedules): the B/W
split on interleaved chunks (interleaved-zb), and the two V schedules (zbv, dualpipev).

    schedule_table(2, 4, "zbv")[0]        -> ["F0.0", "F1.0", "F2.0", "F0.1", "B0.1", "W0.1", ...]
    schedule_table(2, 4, "dualpipev")[0]  -> [..., "F3.0&B1.1", "W1.1", "F2.1&B0.0", ...]

Entry points (pyproject.toml): "refimpl.schedules" (`schedules`), "refimpl.placements"
(`placements`: the V) and "refimpl.strategies" (`shorthands`: pp-interleaved-zb, pp-zbv,
pp-dualpipev).
"""
from __future__ import annotations

from refimpl.mesh import LayoutError
from refimpl.parallel.pp.schedules import (
    PAIR,
    Action,
    Schedule,
    alternate,
    interleaved_actions,
    interleaved_warmup,
    multiple_of_stages,
    piece_of,
)
from refimpl.registry import NAIVE, Entry

FRONTIER = ("interleaved-zb", "zbv", "dualpipev")


def v_shape(rank: int, chunk: int, p: int) -> int:
    """The V (zbv, dualpipev): rank r holds pieces r and 2p-1-r, so the first and last sit on rank 0."""
    return rank if chunk == 0 else 2 * p - 1 - rank


def _texts(rows) -> list[list[str]]:
    return [[PAIR.join(a.text(True) for a in entry) for entry in row] for row in rows]


def _two_chunks(p: int, m: int, v: int, name: str) -> None:
    if v not in (1, 2):
        raise LayoutError(f"{name} places exactly two chunks per rank (a V): --virtual-stages "
                          f"must be 1 or 2, not {v}")


def _dualpipev_check(p: int, m: int, v: int) -> None:
    _two_chunks(p, m, v, "dualpipev")
    if m < 2 * p:
        raise LayoutError(f"dualpipev needs micro-batches ({m}) >= 2 x stages ({2 * p}): its "
                          "steady state pairs a forward with a backward")


def schedules() -> dict[str, Schedule]:
    """The entry point "refimpl.schedules": the frontier's rows, bubbles and checks."""
    return {
        "interleaved-zb": Schedule(lambda p, m, v: _texts(zero_bubble_rows(p, m, v)),
                                   lambda p, m, v: (p - 1) / (3 * v * m + p - 1),
                                   multiple_of_stages, chunks=None, split=True),
        "zbv": Schedule(lambda p, m, v: _texts([_zbv_rank(p, m, r) for r in range(p)]),
                        lambda p, m, v: (p - 1) / (6 * m + p - 1),
                        lambda p, m, v: _two_chunks(p, m, v, "zbv"), chunks=2, split=True, placement="v"),
        "dualpipev": Schedule(lambda p, m, v: _texts([_dualpipev_rank(p, m, r) for r in range(p)]),
                              lambda p, m, v: p / (6 * m + p) if p > 1 else 0.0,
                              _dualpipev_check, chunks=2, split=True, placement="v"),
    }


def placements() -> dict:
    """The entry point "refimpl.placements"."""
    return {"v": v_shape}


def shorthands() -> dict[str, Entry]:
    """The entry point "refimpl.strategies": pp-<schedule>, dp-naive with the world on pp."""
    return {f"pp-{s}": Entry(NAIVE, axis="pp", schedule=s) for s in FRONTIER}


# --- zero bubble (zb-h1: v = 1; interleaved-zb): list scheduling of the W's -------------------------

def zero_bubble_rows(p, m, v):
    """interleaved-zb by list scheduling with unit F = B = W (v = 1 gives schedules.zb_h1's table):
    each rank keeps (interleaved) 1F1B's F/B order; when its next F/B cannot start yet it runs the
    oldest pending W instead, and it must run one first when the next action is a forward and it
    holds as many micro-batch chunks as (interleaved) 1F1B's first rank ever does (the memory
    limit: p for v = 1)."""
    warmup = [interleaved_warmup(p, s, v) for s in range(p)]
    fb = [alternate(interleaved_actions(p, m, v, "F"), interleaved_actions(p, m, v, "B"),
                    min(warmup[s], v * m))
          for s in range(p)]
    limit = min(warmup[0], v * m) + 1          # interleaved 1F1B's first rank: its peak in flight
    n_pieces = p * v
    done, rows, pending = {}, [[] for _ in range(p)], [[] for _ in range(p)]
    t = 0
    while any(fb) or any(pending):
        started = []
        for s in range(p):
            nxt = fb[s][0] if fb[s] else None
            held = sum(a.kind == "F" for a in rows[s]) - sum(a.kind == "W" for a in rows[s])
            must_w = nxt is not None and nxt.kind == "F" and held >= limit
            ready = nxt is not None and _ready(nxt, s, p, n_pieces, done, t)
            if ready and not must_w:
                fb[s].pop(0)
                started.append((s, nxt))
            elif pending[s]:
                started.append((s, pending[s].pop(0)))
        for s, a in started:
            rows[s].append(a)
            done[(a.kind, a.micro_batch, piece_of(s, a.chunk, p))] = t + 1
            if a.kind == "B":
                pending[s].append(Action("W", a.micro_batch, a.chunk))
        t += 1
        if t > 4 * p * v * m + 4 * p:     # unit actions: a longer construction means a bug here
            raise RuntimeError("interleaved-zb construction did not finish")
    return [[[a] for a in row] for row in rows]


def _ready(a, s, p, n_pieces, done, t):
    k, mb = piece_of(s, a.chunk, p), a.micro_batch
    if a.kind == "F":
        return k == 0 or done.get(("F", mb, k - 1), t + 1) <= t
    upstream = ("F", mb, k) if k == n_pieces - 1 else ("B", mb, k + 1)
    return done.get(upstream, t + 1) <= t


# --- the V schedules: their orders written out phase by phase ----------------------------------------

class _Row:
    """One rank's row under construction: counters of the next F, B, W of each chunk."""

    def __init__(self, m):
        self.m, self.entries = m, []
        self.next = {(k, c): 0 for k in "FBW" for c in (0, 1)}
        self.deferred: list[Action] = []         # B done, W not yet: oldest first

    def take(self, kind, chunk) -> Action:
        mb = self.next[(kind, chunk)]
        self.next[(kind, chunk)] += 1
        return Action(kind, mb, chunk)

    def add(self, *actions):
        """One entry (two actions: an overlapped pair); the dropped micro-batches (>= m) vanish."""
        kept = [a for a in actions if a.micro_batch < self.m]
        if kept:
            self.entries.append(kept)

    def backward(self, chunk, whole=True, pair_with=None):
        """B of `chunk`, with its W at once (whole) or deferred; `pair_with`: the F it overlaps."""
        b = self.take("B", chunk)
        self.add(*([pair_with] if pair_with else []), b)
        w = self.take("W", chunk)
        if whole:
            self.add(w)
        else:
            self.deferred.append(w)

    def deferred_w(self):
        if self.deferred:
            self.add(self.deferred.pop(0))


def _zbv_rank(p, m, r):
    n = max(m, 2 * p - 1)
    row = _Row(m)
    for _ in range(2 * (p - r) - 1):
        row.add(row.take("F", 0))
    for _ in range(r):
        row.add(row.take("F", 1))
        row.add(row.take("F", 0))
    for _ in range(p - r):
        row.add(row.take("F", 1))
        row.backward(1)
    while row.next[("F", 1)] < n:            # steady state: each chunk F, B, W in turn
        if row.next[("F", 0)] < n:
            row.add(row.take("F", 0))
        row.backward(0)
        row.add(row.take("F", 1))
        row.backward(1)
    for _ in range(r):                        # drain: B's first (others wait on them), W's after
        row.backward(0, whole=False)
        row.backward(1, whole=False)
    for _ in range(p - r):
        row.backward(0, whole=False)
        row.deferred_w()
    while row.deferred:
        row.deferred_w()
    return row.entries


def _dualpipev_rank(p, m, r):
    row = _Row(m)
    for _ in range(2 * (p - r - 1)):          # warm-up: chunk 0 forwards, then both chunks'
        row.add(row.take("F", 0))
    for _ in range(r + 1):
        row.add(row.take("F", 0))
        row.add(row.take("F", 1))
    for _ in range(p - r - 1):                # chunk 1's first backwards, W's deferred
        row.backward(1, whole=False)
        row.deferred_w()
        row.add(row.take("F", 1))
    for i in range(m - 2 * p + r + 1):        # steady state: F&B pairs, across the two chunks
        if i == 0 and r == p - 1:             # the V's bottom: its backward waits on that forward
            row.add(row.take("F", 0))
            row.backward(1)
        else:
            row.backward(1, pair_with=row.take("F", 0))
        row.backward(0, pair_with=row.take("F", 1))
    for _ in range(p - r - 1):                # chunk 0's forwards are done: chunk 1's still pair
        row.backward(1)
        row.backward(0, pair_with=row.take("F", 1))
    half = (r + 1) // 2                       # drain: the later half defers W into the tail
    for i in range(r + 1):
        row.backward(1, whole=i < half)
        row.backward(0, whole=i < half)
    for _ in range(p - r - 1):
        row.deferred_w()
        row.backward(0, whole=False)
    while row.deferred:
        row.deferred_w()
    return row.entries
