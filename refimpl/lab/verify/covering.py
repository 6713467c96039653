"""Covering arrays: few rows such that every t values of t different factors that can occur together
do occur together in some row (Cohen et al. 1997, "The AETG System"; Kuhn et al. 2004 found that
most interaction faults need no more than two or three factors to show).

A row is a tuple with one entry per factor; None marks a factor that does not apply to that row
(the capacity scope of a dense model) and takes part in no t-tuple. `tuples(row, t)` are the
t-tuples a row holds. `greedy_cover` picks rows until every required t-tuple is covered, each time
the row that covers the most not yet covered per unit of cost (Chvátal 1979's greedy for weighted
set cover), scored lazily: a row's gain only shrinks as others are picked, so a stale score is an
upper bound and only the row on top of the heap needs scoring anew (Minoux 1978).
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter
from typing import Callable, Iterable, Sequence

Row = tuple


def tuples(row: Row, t: int) -> Iterable[tuple]:
    """Every t-tuple of (factor index, value) the row holds, factors in index order."""
    items = [(i, v) for i, v in enumerate(row) if v is not None]
    return itertools.combinations(items, t)


def greedy_cover(rows: Sequence[Row], covers: Callable[[Row], set], required: set,
                 cost: Callable[[Row], float] = lambda r: 1.0) -> list[Row]:
    """Rows of `rows` that together cover `required`; `covers(row)`: the tuples a row vouches
    for (all it holds, or fewer: a row whose check is loose vouches only for some)."""
    todo = set(required)
    heap = []
    for i, row in enumerate(rows):
        gain = len(covers(row) & todo)
        if gain:
            heap.append((-gain / cost(row), i))
    heapq.heapify(heap)
    chosen = []
    while todo and heap:
        _, i = heapq.heappop(heap)
        gain = covers(rows[i]) & todo
        if not gain:
            continue
        score = -len(gain) / cost(rows[i])
        if heap and score > heap[0][0]:        # stale: score it anew and put it back
            heapq.heappush(heap, (score, i))
            continue
        chosen.append(rows[i])
        todo -= gain
    if todo:
        raise ValueError(f"{len(todo)} required tuples occur in none of the rows, e.g. "
                         f"{sorted(todo, key=repr)[:3]}")
    return chosen


def constructed_cover(required: set, t: int, build: Callable, covers: Callable[[Row], set],
                      cost: Callable[[Row], float], rng, candidates: int = 12) -> list[Row]:
    """AETG's construction (Cohen et al. 1997, §3): row by row, `candidates` rows are built, each
    around a t-tuple not yet covered, and the one that covers the most not yet covered per unit
    of cost is kept. `build(seed_tuple, score, rng)` builds a row holding the tuple, choosing each
    other factor's value by `score(items_so_far, item)`: how many uncovered t-tuples that value
    would complete; it returns None where no acceptable row was found. Tuples no built row
    covers are then left to the rows of `greedy_cover` over nothing: the error names them."""
    todo = set(required)
    chosen: list[Row] = []

    def score(items: list, item) -> int:
        n = 0
        for rest in itertools.combinations(items, t - 1):
            key = tuple(sorted((*rest, item)))
            n += key in todo
        return n

    failures = 0
    while todo:
        pending = sorted(todo, key=repr)      # a set's order changes with the hash seed
        best, best_gain, best_score = None, set(), 0.0
        for _ in range(candidates):
            row = build(pending[rng.randrange(len(pending))], score, rng)
            if row is None:
                continue
            gain = covers(row) & todo
            if gain and len(gain) / cost(row) > best_score:
                best, best_gain, best_score = row, gain, len(gain) / cost(row)
        if best is None:
            failures += 1
            if failures > 20:
                raise ValueError(f"{len(todo)} required tuples no acceptable row was built "
                                 f"around, e.g. {sorted(todo, key=repr)[:3]}")
            continue
        failures = 0
        chosen.append(best)
        todo -= best_gain
    return without_redundant(chosen, covers, cost)


def without_redundant(rows: list[Row], covers: Callable[[Row], set],
                      cost: Callable[[Row], float]) -> list[Row]:
    """`rows` less each row whose tuples the rows kept also cover, the costliest looked at
    first: a row built early for its gain may be covered whole by the rows built after it."""
    held = Counter()
    for row in rows:
        held.update(covers(row))
    dropped = set()
    for i in sorted(range(len(rows)), key=lambda i: -cost(rows[i])):
        tuples_of = covers(rows[i])
        if all(held[tup] > 1 for tup in tuples_of):
            held.subtract(tuples_of)
            dropped.add(i)
    return [row for i, row in enumerate(rows) if i not in dropped]
