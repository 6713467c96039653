"""Pipeline schedules as data: the forwards (F), backwards (B) and weight gradients (W) each stage
runs, in order (seed 000, sec. 3.4). Pure Python: no torch, no process group.

    schedule_table(4, 8, "1f1b")[3]  ->  ["F0", "B0", "F1", "B1", ...]     # the last stage"""
from __future__ import annotations

from refimpl.mesh import LayoutError

# The vocabulary of a table (actions, pairs, placement) lives in actions.py, shared with frontier.py.
from refimpl.parallel.pp.actions import (  # noqa: F401
    PAIR,
    SPLIT_SCHEDULES,
    V_SCHEDULES,
    Action,
    _backwards,
    _forwards,
    _interleaved,
    _one_f_one_b,
    chunks_per_rank,
    flat,
    interleaved_warmup,
    parse_entry,
    piece_of,
    placement,
    rank_of,
)
from refimpl.parallel.pp.frontier import frontier_table

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "interleaved-zb", "zbv", "dualpipev")


def check_layout(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> None:
    """Raise LayoutError (one line) if this schedule cannot run with these sizes."""
    if schedule not in SCHEDULES:
        raise LayoutError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or micro_batches < 1 or virtual_stages < 1:
        raise LayoutError("pipeline stages, micro-batches and virtual stages must all be >= 1")
    if schedule in V_SCHEDULES:
        if virtual_stages not in (1, 2):
            raise LayoutError(f"{schedule} places exactly two chunks per rank (a V): --virtual-stages "
                              f"must be 1 or 2, not {virtual_stages}")
        if schedule == "dualpipev" and micro_batches < 2 * stages:
            raise LayoutError(f"dualpipev needs micro-batches ({micro_batches}) >= 2 x stages "
                              f"({2 * stages}): its steady state pairs a forward with a backward")
        return
    if not schedule.startswith("interleaved") and virtual_stages != 1:
        raise LayoutError(f"--virtual-stages {virtual_stages} needs an interleaved schedule")
    if schedule.startswith("interleaved") and micro_batches % stages:
        raise LayoutError(f"{schedule} needs micro-batches ({micro_batches}) to be a multiple "
                          f"of pipeline stages ({stages})")


def pipeline_schedule(cfg) -> str:
    """The schedule a layout runs: --schedule (a pp-* shorthand sets it: refimpl.registry), else 1f1b."""
    return cfg.schedule or "1f1b"


def one_f_one_b(p: int, m: int, stage: int) -> list[Action]:
    """1F1B: warm up with the forwards of the stages after this one, then alternate."""
    return _one_f_one_b(_forwards(m), _backwards(m), min(p - stage - 1, m))


def zb_h1(p: int, m: int, stage: int) -> list[Action]:
    """ZB-H1: 1F1B's order, each W_i deferred until after B_(i+d). d = stage fills exactly the
    time stage s would wait (p in flight on every stage, 1F1B's first stage's memory); with m < p
    the pipeline never fills and p - m stages fewer need the room."""
    d = max(0, stage - max(0, p - m))
    order = []
    for a in one_f_one_b(p, m, stage):
        order.append(a)
        if a.kind == "B" and a.micro_batch >= d:
            order.append(Action("W", a.micro_batch - d))
    return order + [Action("W", i) for i in range(max(0, m - d), m)]


def schedule_table(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> list[list[str]]:
    """One list per rank (pipeline stage) of its actions in execution order."""
    check_layout(stages, micro_batches, schedule, virtual_stages)
    p, m, v = stages, micro_batches, virtual_stages
    if schedule == "gpipe":
        orders = [_forwards(m) + _backwards(m) for _ in range(p)]
    elif schedule == "1f1b":
        orders = [one_f_one_b(p, m, s) for s in range(p)]
    elif schedule == "interleaved":
        orders = [_one_f_one_b(_interleaved(p, m, v, "F"), _interleaved(p, m, v, "B"),
                               min(interleaved_warmup(p, s, v), v * m)) for s in range(p)]
    elif schedule == "zb-h1":
        orders = [zb_h1(p, m, s) for s in range(p)]
    else:
        return frontier_table(p, m, schedule, v)
    return [[a.text(schedule == "interleaved") for a in order] for order in orders]


# --- the bubble, in closed form -------------------------------------------------------------------

def bubble_fraction(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> float:
    """Idle share of the step, (idle time) / (step time), when every micro-batch costs the same."""
    check_layout(stages, micro_batches, schedule, virtual_stages)
    p, m, v = stages, micro_batches, virtual_stages
    if schedule == "dualpipev":
        return p / (6 * m + p) if p > 1 else 0.0
    work = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb-h1": 3 * m, "interleaved-zb": 3 * v * m,
            "zbv": 6 * m}[schedule]
    return (p - 1) / (work + p - 1)


def bubble_over_ideal(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> float:
    """Narayanan et al. 2021's normalisation, bubble time / ideal time: f / (1 - f) for the
    bubble_fraction f ((p-1)/m for gpipe and 1f1b); it can exceed 1."""
    f = bubble_fraction(stages, micro_batches, schedule, virtual_stages)
    return f / (1 - f)
