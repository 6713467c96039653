"""Replay a schedule table with given F, B, W durations, and check that a table is a valid schedule.

How the closed-form bubbles of refimpl.parallel.pp.schedules.bubble_fraction are *checked* rather
than restated: each rank runs its actions in the table's order, each as early as its dependencies
(refimpl.parallel.pp.order.dependencies) allow, and the idle share is read off the timeline. Sends
never block (the runner uses isend), so a table the replay cannot finish would deadlock the runner
too. An overlapped pair "F5.0&B1.1" starts once both its actions could; its F then its B take their
durations back to back.
"""
from __future__ import annotations

from dataclasses import dataclass

from refimpl.parallel.pp.order import ScheduleError, dependencies, n_pieces  # noqa: F401
from refimpl.parallel.pp.schedules import (
    PAIR,
    Action,
    parse_entry,
    piece_of,
    placement,
    rank_of,
    schedule_table,
    schedules,
)


@dataclass(frozen=True)
class TimedAction:
    """One action of a replayed (or measured) step: which rank ran it, from when to when."""
    rank: int
    action: str
    start: float
    end: float


def flat(row: list[str]) -> list[str]:
    """A row with its pairs split into their actions, in the order the runner runs them."""
    return [t for entry in row for t in entry.split(PAIR)]


def _parse(table):
    return [[parse_entry(entry) for entry in row] for row in table]


def simulate(table, F: float = 1.0, B: float = 1.0, W: float = 0.0, comm: float = 0.0,
             per_rank: list[dict] | None = None, where: str = "loop", action_cost: float = 0.0,
             per_action: dict[tuple[int, str], float] | None = None,
             recv_cost: float = 0.0) -> list[TimedAction]:
    """Earliest start of every action given the table's per-rank order; `comm` is added to every
    dependency that crosses ranks; `per_rank[r]` ({"F": .., "B": .., "W": ..}) overrides the
    durations on rank r (stages that are not equal: the first embeds, the last has the head);
    `where`: the placement ("v" for zbv, dualpipev: schedules.placement); `action_cost`: time every
    action pays outside its compute (dispatch, posting its receives, the wait's own cost);
    `recv_cost`: what an action that takes a message from another rank pays to complete that
    receive when the message is already there (its wait and the copy out of the transport): such
    an action starts at free + recv_cost if its message arrived while the rank was busy, else at
    arrival + comm (at least free + recv_cost), then pays action_cost; a message is paid for by
    collecting it or by waiting for it, never both (measured_costs measures the three so);
    `per_action[(rank, "B3")]`: one action's own duration (a measured step, action by action),
    over the per-rank one. Raises ScheduleError if the ranks would wait on each other forever."""
    ranks = _parse(table)
    p, n_virtual = len(ranks), n_pieces(ranks)
    durations = [{"F": F, "B": B, "W": W, **(per_rank[r] if per_rank else {})} for r in range(p)]
    end: dict[tuple[str, int, int], float] = {}
    owner: dict[tuple[str, int, int], int] = {}
    nxt, free, slots = [0] * p, [0.0] * p, []
    while any(nxt[r] < len(ranks[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(ranks[r]):
                entry = ranks[r][nxt[r]]
                deps = [d for a in entry for d in dependencies(a, r, p, n_virtual, where)]
                if any(d not in end for d in deps):
                    break
                t = max([free[r]] + [end[d] for d in deps if owner[d] == r])
                arrival = max((end[d] for d in deps if owner[d] != r), default=None)
                if arrival is not None:      # a message: collected, or waited for (measured_costs)
                    t = t + recv_cost if arrival <= t else max(arrival + comm, t + recv_cost)
                for a, text in zip(entry, table[r][nxt[r]].split(PAIR)):   # a pair: F, then B
                    t += action_cost
                    key = (a.kind, a.micro_batch, piece_of(r, a.chunk, p, where))
                    took = per_action.get((r, text), durations[r][a.kind]) if per_action else durations[r][a.kind]
                    end[key], owner[key] = t + took, r
                    slots.append(TimedAction(r, text, t, end[key]))
                    t = end[key]
                free[r] = t
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
    per stage, a chunk costing 1/v of that; the split schedules with F = B = W (the paper's
    assumption), a chunk again 1/v of a stage."""
    table = schedule_table(stages, micro_batches, schedule, virtual_stages)
    v = 2 if schedule in ("zbv", "dualpipev") else virtual_stages
    if schedules()[schedule].split:
        return idle_fraction(simulate(table, F=1 / v, B=1 / v, W=1 / v, where=placement(schedule)))
    return idle_fraction(simulate(table, F=1 / v, B=2 / v))


# --- checking a table ------------------------------------------------------------------------------

def in_flight(actions: list[str]) -> list[int]:
    """After each action: micro-batches (per chunk) whose activations this rank still holds, i.e.
    forward done and backward not finished (the weight gradient W, when the table has one, is last)."""
    parsed = [Action.parse(a) for a in flat(actions)]
    last = "W" if any(a.kind == "W" for a in parsed) else "B"
    count, out = 0, []
    for a in parsed:
        count += (a.kind == "F") - (a.kind == last)
        out.append(count)
    return out


def in_flight_limit(stages: int, micro_batches: int, schedule: str, stage: int,
                    virtual_stages: int = 1) -> int | None:
    """What the schedule promises, in micro-batch chunks: GPipe m, 1F1B p - stage, ZB-H1 p (1F1B's
    first stage), interleaved-zb interleaved 1F1B's first rank, zbv 2p chunks (p whole stages:
    1F1B's first stage again), dualpipev 2p + 1 (its README: one more than 1F1B's)."""
    p, m, v = stages, micro_batches, virtual_stages
    first_interleaved = min((p - 1) * 2 + (v - 1) * p if v > 1 else p - 1, v * m) + 1
    return {"gpipe": m, "1f1b": p - stage, "zb-h1": p, "interleaved-zb": first_interleaved,
            "zbv": 2 * p, "dualpipev": 2 * p + 1}.get(schedule)


def check_table(table, stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> None:
    """Raise ScheduleError unless: every rank runs each of its (micro-batch, chunk)'s F and B -- and W
    for the split schedules -- exactly once, F before B before W; the ranks can run it without
    deadlock with every cross-rank dependency respected; and the in-flight micro-batches stay within
    the schedule's limit. (The order of messages is the runner's concern: `posting_order_mismatch`.)"""
    if len(table) != stages:
        raise ScheduleError(f"{len(table)} ranks in the table, {stages} stages expected")
    kinds = "FBW" if schedules()[schedule].split else "FB"
    v = 2 if schedule in ("zbv", "dualpipev") else virtual_stages
    want = sorted((k, mb, c) for k in kinds for mb in range(micro_batches) for c in range(v))
    for r, entries in enumerate(table):
        actions = flat(entries)
        parsed = [Action.parse(a) for a in actions]
        got = sorted((a.kind, a.micro_batch, a.chunk) for a in parsed)
        if got != want:
            missing = sorted(set(want) - set(got)) or "none missing, some repeated"
            raise ScheduleError(f"rank {r}: not every F/B{'/W' if len(kinds) > 2 else ''} exactly once "
                                f"(missing {missing})")
        position = {(a.kind, a.micro_batch, a.chunk): i for i, a in enumerate(parsed)}
        for kind, mb, c in want:
            before = kinds[kinds.index(kind) - 1] if kind != "F" else None
            if before and position[(before, mb, c)] > position[(kind, mb, c)]:
                name = Action(kind, mb, c).text(v > 1 or schedule == "interleaved")
                raise ScheduleError(f"rank {r}: {name} runs before its {before}")
        for entry in map(parse_entry, entries):
            if len(entry) > 1 and [a.kind for a in entry] != ["F", "B"]:
                raise ScheduleError(f"rank {r}: an overlapped entry is one F and one B, not {entry}")
        limit = in_flight_limit(stages, micro_batches, schedule, r, virtual_stages)
        peak = max(in_flight(entries), default=0)
        if limit is not None and peak > limit:
            raise ScheduleError(f"rank {r}: {peak} micro-batches in flight, {schedule} allows {limit}")
    simulate(table, F=1, B=1, W=1, where=placement(schedule))  # raises on a cyclic wait


def messages(table, where: str = "loop") -> tuple[dict, dict]:
    """Per (sender, receiver) pair of ranks, the messages in the order the sender posts them, and in
    the order the receiver posts its receives, as the runner does: one per action that crosses ranks,
    in its row's order (a pair: its F's, then its B's). A message is (kind, micro-batch, piece)."""
    ranks = _parse(table)
    p, n_virtual = len(ranks), n_pieces(ranks)
    sent, received = {}, {}
    for r, row in enumerate(ranks):
        for a in (a for entry in row for a in entry):
            k = piece_of(r, a.chunk, p, where)
            out = {"F": k + 1 if k < n_virtual - 1 else None, "B": k - 1 if k > 0 else None}.get(a.kind)
            into = {"F": k if k > 0 else None, "B": k if k < n_virtual - 1 else None}.get(a.kind)
            if out is not None and rank_of(out, p, where) != r:
                sent.setdefault((r, rank_of(out, p, where)), []).append((a.kind, a.micro_batch, out))
            if into is not None:
                src = rank_of(into + (-1 if a.kind == "F" else 1), p, where)
                if src != r:
                    message = (a.kind, a.micro_batch, into)
                    received.setdefault((src, r), []).append(message)
    return sent, received


def inbox(table, rank: int, where: str = "loop") -> dict[int, list]:
    """What `rank` receives, per sender, in the order the sender sends it: the order in which the
    runner posts its receives (refimpl.parallel.pp.runner), so that one tag pairs them right."""
    sent, _ = messages(table, where)
    return {src: order for (src, dst), order in sent.items() if dst == rank}


def posting_order_mismatch(table, where: str = "loop") -> str | None:
    """The first pair of ranks whose messages would be paired wrongly under one tag if the receiver
    posted its receives in its own row's order, or None. gpipe, 1f1b, interleaved and zb-h1: None;
    zbv and dualpipev: rank 1 wants chunk 1's gradient before the activation rank 0 sends first."""
    sent, received = messages(table, where)
    for link in sorted(set(sent) | set(received)):
        a, b = sent.get(link, []), received.get(link, [])
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"ranks {link[0]}->{link[1]}: message {i} sent is {a[i:i + 1]}, received as "
                    f"{b[i:i + 1]} (NCCL pairs them by posting order)")
    return None
