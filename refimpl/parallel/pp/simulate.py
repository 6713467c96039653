"""Replay a schedule table with given F, B, W durations, and check a table is a valid schedule.

`simulate` is how the closed-form bubbles of `schedules.bubble_fraction` are *checked* rather
than restated: each rank runs its actions in the table's order, each as early as its dependencies
allow, and the idle share is read off the resulting timeline.

Dependencies (virtual stage k = chunk * p + rank; K = p * v virtual stages):
  F(mb, k)  after F(mb, k-1)                  the activation arrives from the previous stage
  B(mb, k)  after B(mb, k+1), or after F(mb, K-1) on the last one (the loss is there)
            and after its own F(mb, k)          the saved activations are needed
  W(mb, k)  after its own B(mb, k)             the output gradient B received
plus each rank runs one action at a time, in table order. Sends never block (the runner uses
isend), so the only waits are these: a table the replay cannot finish would deadlock the runner too.
"""
from __future__ import annotations

from dataclasses import dataclass

from refimpl.parallel.pp.schedules import Action, schedule_table


class ScheduleError(ValueError):
    """A table that is not a valid pipeline schedule; the message names the first violation."""


@dataclass(frozen=True)
class TimedAction:
    """One action of a replayed (or measured) step: which rank ran it, from when to when."""
    rank: int
    action: str
    start: float
    end: float


def _parse(table):
    return [[Action.parse(a) for a in actions] for actions in table]


def _virtual_stages(actions_per_rank) -> int:
    return 1 + max((a.chunk for actions in actions_per_rank for a in actions), default=0)


def _dependencies(a: Action, rank: int, p: int, n_virtual: int) -> list[tuple[str, int, int]]:
    """(kind, micro-batch, virtual stage) of the actions `a` waits for."""
    k = a.chunk * p + rank
    if a.kind == "F":
        return [("F", a.micro_batch, k - 1)] if k > 0 else []
    if a.kind == "B":
        upstream = ("B", a.micro_batch, k + 1) if k < n_virtual - 1 else ("F", a.micro_batch, k)
        return [upstream, ("F", a.micro_batch, k)]
    return [("B", a.micro_batch, k)]


def simulate(table, F: float = 1.0, B: float = 1.0, W: float = 0.0, comm: float = 0.0,
             per_rank: list[dict] | None = None) -> list[TimedAction]:
    """Earliest start of every action given the table's per-rank order; `comm` is added to every
    dependency that crosses ranks; `per_rank[r]` ({"F": .., "B": .., "W": ..}) overrides the
    durations on rank r (stages that are not equal: the first embeds, the last has the head).
    Raises ScheduleError if the ranks would wait on each other forever."""
    ranks = _parse(table)
    p, n_virtual = len(ranks), len(ranks) * _virtual_stages(ranks)
    durations = [{"F": F, "B": B, "W": W, **(per_rank[r] if per_rank else {})} for r in range(p)]
    end: dict[tuple[str, int, int], float] = {}
    owner: dict[tuple[str, int, int], int] = {}
    nxt, free, slots = [0] * p, [0.0] * p, []
    while any(nxt[r] < len(ranks[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(ranks[r]):
                a = ranks[r][nxt[r]]
                deps = _dependencies(a, r, p, n_virtual)
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] + (comm if owner[d] != r else 0.0) for d in deps])
                key = (a.kind, a.micro_batch, a.chunk * p + r)
                end[key], owner[key] = start + durations[r][a.kind], r
                free[r] = end[key]
                slots.append(TimedAction(r, table[r][nxt[r]], start, end[key]))
                nxt[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: table[r][nxt[r]] for r in range(p) if nxt[r] < len(ranks[r])}
            raise ScheduleError(f"deadlock: every rank waits ({stuck})")
    return slots


def idle_fraction(slots: list[TimedAction]) -> float:
    """Share of (ranks x step time) in which no rank computes: the measured bubble."""
    ranks = {s.rank for s in slots}
    makespan = max(s.end for s in slots) - min(s.start for s in slots)
    busy = sum(s.end - s.start for s in slots)
    return 1 - busy / (makespan * len(ranks))


def simulated_bubble(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> float:
    """The idle share of `schedule_table` replayed with equal per-micro-batch costs: F = 1, B + W = 2
    per stage, a chunk costing 1/v of that; zb-h1 with F = B = W = 1 (the paper's assumption)."""
    table = schedule_table(stages, micro_batches, schedule, virtual_stages)
    v = virtual_stages
    if schedule == "zb-h1":
        return idle_fraction(simulate(table, F=1, B=1, W=1))
    return idle_fraction(simulate(table, F=1 / v, B=2 / v))


# --- checking a table ------------------------------------------------------------------------------

def in_flight(actions: list[str]) -> list[int]:
    """After each action: micro-batches (per chunk) whose activations this rank still holds, i.e.
    forward done and backward not finished (the weight gradient W, when the table has one, is last)."""
    parsed = [Action.parse(a) for a in actions]
    last = "W" if any(a.kind == "W" for a in parsed) else "B"
    count, out = 0, []
    for a in parsed:
        count += (a.kind == "F") - (a.kind == last)
        out.append(count)
    return out


def in_flight_limit(stages: int, micro_batches: int, schedule: str, stage: int) -> int | None:
    """What the schedule promises: GPipe m, 1F1B p - stage, ZB-H1 p (1F1B's first stage)."""
    return {"gpipe": micro_batches, "1f1b": stages - stage, "zb-h1": stages}.get(schedule)


def check_table(table, stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> None:
    """Raise ScheduleError unless: every rank runs each of its (micro-batch, chunk)'s F and B -- and W
    for zb-h1 -- exactly once, F before B before W; the ranks can run it without deadlock with every
    cross-rank dependency respected; and the in-flight micro-batches stay within the schedule's limit."""
    if len(table) != stages:
        raise ScheduleError(f"{len(table)} ranks in the table, {stages} stages expected")
    kinds = "FBW" if schedule == "zb-h1" else "FB"
    want = sorted((k, mb, c) for k in kinds for mb in range(micro_batches) for c in range(virtual_stages))
    for r, actions in enumerate(table):
        got = sorted((a.kind, a.micro_batch, a.chunk) for a in map(Action.parse, actions))
        if got != want:
            missing = sorted(set(want) - set(got)) or "none missing, some repeated"
            raise ScheduleError(f"rank {r}: not every F/B{'/W' if len(kinds) > 2 else ''} exactly once "
                                f"(missing {missing})")
        position = {a: i for i, a in enumerate(actions)}
        for kind, mb, c in want:
            name = Action(kind, mb, c).text(virtual_stages > 1 or schedule == "interleaved")
            before = kinds[kinds.index(kind) - 1] if kind != "F" else None
            if before and position[Action(before, mb, c).text(
                    virtual_stages > 1 or schedule == "interleaved")] > position[name]:
                raise ScheduleError(f"rank {r}: {name} runs before its {before}")
        limit = in_flight_limit(stages, micro_batches, schedule, r)
        peak = max(in_flight(actions), default=0)
        if limit is not None and peak > limit:
            raise ScheduleError(f"rank {r}: {peak} micro-batches in flight, {schedule} allows {limit}")
    simulate(table, F=1, B=1, W=1)  # raises on a cyclic wait
