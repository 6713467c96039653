"""The schedule tables replayed with equal costs: what notebook 07 §2-3 draw and check.

`replay_frame` is one table run through `simulate` with the costs the closed forms assume (F = 1,
B = 2 per stage, a chunk 1/v of that; ZB-H1 F = B = W = 1: Qi et al. 2023 §2.2), one row per
action. `bubble_sweep` puts, for each (m, schedule), the replayed idle share beside
`bubble_fraction`, and the replayed bubble over ideal beside `bubble_over_ideal` (Narayanan et al.
2021's normalisation): each closed form against a quantity measured on the replay.
`micro_batch_latency` reads, off any timeline (replayed or traced), how long each micro-batch takes
from its first forward to its last backward: the latency the seed (§3.4) says pipelining adds.
"""
from __future__ import annotations

import pandas as pd

from refimpl.lab.pipeline.simulate import idle_fraction, simulate
from refimpl.parallel.pp.schedules import bubble_fraction, parse_entry, schedule_table


def bubble_over_ideal(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> float:
    """Narayanan et al. 2021's normalisation, bubble time / ideal time: f / (1 - f) for the
    bubble_fraction f ((p-1)/m for gpipe and 1f1b); it can exceed 1."""
    f = bubble_fraction(stages, micro_batches, schedule, virtual_stages)
    return f / (1 - f)


def equal_costs(schedule: str, virtual_stages: int = 1) -> dict:
    """The per-action costs the closed forms assume."""
    if schedule == "zb-h1":
        return {"F": 1, "B": 1, "W": 1}
    return {"F": 1 / virtual_stages, "B": 2 / virtual_stages}


def replay(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> list:
    table = schedule_table(stages, micro_batches, schedule, virtual_stages)
    return simulate(table, **equal_costs(schedule, virtual_stages))


def replay_frame(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> pd.DataFrame:
    """rank, action, start, end of every action of the replayed table (plots.pipeline_gantt's input)."""
    return pd.DataFrame([s.__dict__ for s in replay(stages, micro_batches, schedule, virtual_stages)])


def over_ideal(slots) -> float:
    """Bubble time over ideal time, measured on replayed (or traced) slots: the idle time of one
    rank, (ranks x span - busy) / ranks, over one rank's work, busy / ranks."""
    ranks = {s.rank for s in slots}
    span = max(s.end for s in slots) - min(s.start for s in slots)
    busy = sum(s.end - s.start for s in slots)
    return (span * len(ranks) - busy) / busy


def bubble_sweep(stages: int, micro_batches=(1, 2, 4, 8, 16, 32),
                 cases=(("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1))) -> pd.DataFrame:
    """One row per (m, schedule) the layout allows (interleaved needs m divisible by the stages)."""
    rows = []
    for m in micro_batches:
        for schedule, v in cases:
            if schedule == "interleaved" and m % stages:
                continue
            slots = replay(stages, m, schedule, v)
            rows.append({"m": m, "schedule": schedule if v == 1 else f"{schedule} v={v}",
                         "replayed": idle_fraction(slots), "formula": bubble_fraction(stages, m, schedule, v),
                         "replayed over ideal": over_ideal(slots),
                         "over ideal": bubble_over_ideal(stages, m, schedule, v)})
    return pd.DataFrame(rows)


def imbalanced_step(stages: int, micro_batches: int, slow_stage: int, factor: float,
                    schedule: str = "1f1b") -> dict:
    """The table replayed with one stage `factor` times slower (F = 1, B = 2 elsewhere): its span
    and idle share. In steady state a pipeline moves at its slowest stage's pace: each extra
    micro-batch adds that stage's F + B to the step, whatever the others cost."""
    per_rank = [{"F": factor, "B": 2 * factor} if r == slow_stage else {"F": 1, "B": 2} for r in range(stages)]
    slots = simulate(schedule_table(stages, micro_batches, schedule), per_rank=per_rank)
    return {"span": max(s.end for s in slots) - min(s.start for s in slots), "idle": idle_fraction(slots)}


def micro_batch_latency(slots) -> pd.DataFrame:
    """One row per micro-batch of a timeline (simulate's TimedActions or a frame with rank, action,
    start, end: replay_frame, measure.action_slots for one step): `start`, its first forward's
    start on any stage; `end`, its last backward's end; `latency`, end - start; `work`, the time
    its own F and B actions ran; `waiting`, the rest: the hops between stages and the time its
    stages spent on other micro-batches in between. Seed 000 §3.4: each micro-batch passes the
    stages one after another, so a pipeline adds latency to every micro-batch. A weight-gradient
    W (zero bubble) is left out: deferred to fill a bubble, it holds nothing up. An overlapped
    pair (dualpipev's "F5.0&B1.1") counts for both of its micro-batches."""
    rows = slots.itertuples() if isinstance(slots, pd.DataFrame) else slots
    per = {}
    for s in rows:
        for a in parse_entry(s.action):
            if a.kind == "W":
                continue
            mb = per.setdefault(a.micro_batch, {"start": float("inf"), "end": float("-inf"), "work": 0.0})
            if a.kind == "F":
                mb["start"] = min(mb["start"], s.start)
            else:
                mb["end"] = max(mb["end"], s.end)
            mb["work"] += s.end - s.start
    out = pd.DataFrame.from_dict(per, orient="index").sort_index().rename_axis("micro_batch")
    out["latency"] = out.end - out.start
    out["waiting"] = out.latency - out.work
    return out[["start", "end", "latency", "work", "waiting"]]
