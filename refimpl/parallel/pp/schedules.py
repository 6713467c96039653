"""Pipeline schedules as data (seed 000, sec. 3.4): row r is what pipeline rank r runs, in order.

    schedule_table(4, 8, "1f1b")[3]  ->  ["F0", "B0", "F1", "B1", ...]     # the last stage
    bubble_fraction(p, m, "1f1b")    ->  (p - 1) / (m + p - 1)

F forward, B backward (the input gradient only when W, the weight gradient, is split off); "F3.1"
is micro-batch 3 on chunk 1, "F5.0&B1.1" a pair. Plug-ins add schedules and placements.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from refimpl.mesh import LayoutError
from refimpl.seam import plugins

PAIR = "&"
_ACTION = re.compile(r"^(?P<kind>[FBW])(?P<mb>\d+)(?:\.(?P<chunk>\d+))?$")


@dataclass(frozen=True)
class Action:
    kind: str          # "F", "B" or "W"
    micro_batch: int
    chunk: int = 0     # the model chunk on this rank (interleaved: piece chunk * p + rank)

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text)
        if not match:
            raise ValueError(f"not a pipeline action: {text!r} (want e.g. F3, B3, W3, F3.1)")
        return cls(match["kind"], int(match["mb"]), int(match["chunk"] or 0))

    def text(self, chunked: bool) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if chunked else "")


def parse_entry(text: str) -> list[Action]:
    """A table entry: one action, or a pair "F5.0&B1.1" (forward first)."""
    return [Action.parse(t) for t in text.split(PAIR)]


def round_robin(rank: int, chunk: int, p: int) -> int:
    """Where each chunk lives (Narayanan et al. 2021): chunk c of rank r is piece c*p + r."""
    return chunk * p + rank


@dataclass(frozen=True)
class Schedule:
    """One schedule: its rows (p, m, v) -> [[entry, ...] per rank] and its bubble (p, m, v)."""
    rows: Callable[[int, int, int], list[list[str]]]
    bubble: Callable[[int, int, int], float]
    check: Callable[[int, int, int], None] = lambda p, m, v: None
    chunks: int | None = 1        # chunks per rank; None: --virtual-stages says
    split: bool = False           # B and W split: its rows have W's
    placement: str = "loop"


def forwards(m: int) -> list[Action]:
    return [Action("F", i) for i in range(m)]


def backwards(m: int) -> list[Action]:
    return [Action("B", i) for i in range(m)]


def alternate(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """Megatron's three loops: `warmup` forwards, then one forward + one backward, then cool-down."""
    order = fwd[:warmup]
    for i, f in enumerate(fwd[warmup:]):
        order += [f, bwd[i]]
    return order + bwd[len(fwd) - warmup:]


def one_f_one_b(p: int, m: int, stage: int) -> list[Action]:
    """1F1B: warm up with the forwards of the stages after this one, then alternate."""
    return alternate(forwards(m), backwards(m), min(p - stage - 1, m))


def interleaved_warmup(p: int, stage: int, v: int) -> int:
    """Forwards before the first backward: the later ranks twice, plus p per extra chunk."""
    return (p - stage - 1) * 2 + (v - 1) * p if v > 1 else p - stage - 1


def interleaved_actions(p: int, m: int, v: int, kind: str) -> list[Action]:
    """The k-th action takes micro-batch (k // pv) * p + k % p on chunk (k // p) % v (backwards:
    the chunks reversed): p micro-batches at a time, each group filling the pipeline once."""
    actions = []
    for k in range(v * m):
        group, within = divmod(k, p * v)
        chunk = within // p if kind == "F" else v - 1 - within // p
        actions.append(Action(kind, group * p + within % p, chunk))
    return actions


def interleaved(p: int, m: int, stage: int, v: int) -> list[Action]:
    fwd, bwd = interleaved_actions(p, m, v, "F"), interleaved_actions(p, m, v, "B")
    return alternate(fwd, bwd, min(interleaved_warmup(p, stage, v), v * m))


def zb_h1(p: int, m: int, stage: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023): 1F1B's order, each W_i deferred until after B_(i+d), d = stage
    (fewer when m < p): the idle time of 1F1B's warm-up, filled with W's."""
    d = max(0, stage - max(0, p - m))
    order = []
    for a in one_f_one_b(p, m, stage):
        order.append(a)
        if a.kind == "B" and a.micro_batch >= d:
            order.append(Action("W", a.micro_batch - d))
    return order + [Action("W", i) for i in range(max(0, m - d), m)]


def texts(rows: list[list[Action]], chunked: bool = False) -> list[list[str]]:
    return [[a.text(chunked) for a in row] for row in rows]


def multiple_of_stages(p: int, m: int, v: int) -> None:
    if m % p:
        raise LayoutError(f"an interleaved schedule needs micro-batches ({m}) to be a multiple "
                          f"of pipeline stages ({p})")


CORE_SCHEDULES = {
    "gpipe": Schedule(lambda p, m, v: texts([forwards(m) + backwards(m)] * p),
                      lambda p, m, v: (p - 1) / (m + p - 1)),
    "1f1b": Schedule(lambda p, m, v: texts([one_f_one_b(p, m, s) for s in range(p)]),
                     lambda p, m, v: (p - 1) / (m + p - 1)),
    "interleaved": Schedule(lambda p, m, v: texts([interleaved(p, m, s, v) for s in range(p)], True),
                            lambda p, m, v: (p - 1) / (v * m + p - 1), multiple_of_stages, chunks=None),
    "zb-h1": Schedule(lambda p, m, v: texts([zb_h1(p, m, s) for s in range(p)]),
                      lambda p, m, v: (p - 1) / (3 * m + p - 1), split=True),
}
CORE_PLACEMENTS = {"loop": round_robin}


def _with_plugins(table: dict, group: str) -> dict:
    every = dict(table)
    for plugin in plugins(group):
        every.update(plugin())
    return every


@cache
def schedules() -> dict[str, Schedule]:
    """Every schedule: the core's, then each "refimpl.schedules" plug-in's (name -> Schedule)."""
    return _with_plugins(CORE_SCHEDULES, "refimpl.schedules")


@cache
def placements() -> dict:
    """name -> piece_of(rank, chunk, p): the core's, then each "refimpl.placements" plug-in's."""
    return _with_plugins(CORE_PLACEMENTS, "refimpl.placements")


def piece_of(rank: int, chunk: int, p: int, where: str = "loop") -> int:
    """The piece (virtual stage) that chunk `chunk` of `rank` is, under placement `where`."""
    return placements()[where](rank, chunk, p)


def rank_of(piece: int, p: int, where: str = "loop") -> int:
    """The rank holding `piece` (as its chunk piece // p)."""
    return next(r for r in range(p) if piece_of(r, piece // p, p, where) == piece)


def placement(schedule: str) -> str:
    return schedules()[schedule].placement


def chunks_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    return schedules()[schedule].chunks or virtual_stages


def pipeline_schedule(cfg) -> str:
    """The schedule a layout runs: --schedule (a pp-* shorthand sets it), else 1f1b."""
    return cfg.schedule or "1f1b"


def check_layout(p: int, m: int, schedule: str, virtual_stages: int = 1) -> None:
    """Raise LayoutError (one line) if this schedule cannot run with these sizes."""
    if schedule not in schedules():
        raise LayoutError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(schedules())}")
    if p < 1 or m < 1 or virtual_stages < 1:
        raise LayoutError("pipeline stages, micro-batches and virtual stages must all be >= 1")
    if schedules()[schedule].chunks == 1 and virtual_stages != 1:
        raise LayoutError(f"--virtual-stages {virtual_stages} needs an interleaved schedule")
    schedules()[schedule].check(p, m, virtual_stages)


def schedule_table(p: int, m: int, schedule: str, virtual_stages: int = 1) -> list[list[str]]:
    """One list per rank (pipeline stage) of its actions in execution order."""
    check_layout(p, m, schedule, virtual_stages)
    return schedules()[schedule].rows(p, m, chunks_per_rank(schedule, virtual_stages))


def bubble_fraction(p: int, m: int, schedule: str, virtual_stages: int = 1) -> float:
    """Idle share of the step, (idle time) / (step time), when every micro-batch costs the same."""
    check_layout(p, m, schedule, virtual_stages)
    return schedules()[schedule].bubble(p, m, chunks_per_rank(schedule, virtual_stages))
