"""Covering arrays: the fewest rows such that every t values of t different factors that can occur
together do occur together in some row (Cohen et al. 1997, "The AETG System"; Kuhn et al. 2004 on
why t = 2 or 3 catches most interaction faults).

A row is a tuple with one entry per factor; None marks a factor that does not apply to that row
(the capacity scope of a dense model), and takes part in no t-tuple. `tuples(row, t)` are the
t-tuples a row covers; `greedy_cover(rows, t)` picks rows from the given ones until every
t-tuple any of them covers is covered, each time the row that covers the most not yet covered
(ties: the cheaper, by `cost`), with lazy re-scoring: a row's gain can only shrink as others are
picked, so a stale score is an upper bound (Minoux 1978's accelerated greedy).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable, Sequence

Row = tuple


def tuples(row: Row, t: int) -> Iterable[tuple]:
    """Every t-tuple of (factor index, value) the row covers, factors in index order."""
    items = [(i, v) for i, v in enumerate(row) if v is not None]
    return itertools.combinations(items, t)


def covered(rows: Iterable[Row], t: int) -> set:
    out: set = set()
    for row in rows:
        out.update(tuples(row, t))
    return out


def greedy_cover(rows: Sequence[Row], t: int, cost: Callable[[Row], float] = lambda r: 1.0,
                 required: set | None = None) -> list[Row]:
    """Rows of `rows` that together cover `required` (default: every t-tuple any row covers)."""
    todo = covered(rows, t) if required is None else set(required)
    heap = [(-len(set(tuples(r, t)) & todo), cost(r), i) for i, r in enumerate(rows)]
    heapq.heapify(heap)
    chosen = []
    while todo and heap:
        _, c, i = heapq.heappop(heap)
        gain = set(tuples(rows[i], t)) & todo
        if not gain:
            continue
        if heap and (-len(gain), c) > heap[0][:2]:    # stale: score it anew and put it back
            heapq.heappush(heap, (-len(gain), c, i))
            continue
        chosen.append(rows[i])
        todo -= gain
    if todo:
        raise ValueError(f"{len(todo)} required {t}-tuples occur in none of the rows, e.g. "
                         f"{sorted(todo)[:3]}")
    return chosen
