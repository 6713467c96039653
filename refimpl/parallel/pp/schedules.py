"""Pipeline schedules as data: which forward (F), backward (B) and weight-gradient (W) each stage runs,
in what order. Pure Python: no torch, no process group.

    schedule_table(4, 8, "1f1b")[3]  ->  ["F0", "B0", "F1", "B1", ...]     # the last stage
    schedule_table(2, 4, "interleaved", virtual_stages=2)[0] -> ["F0.0", "F1.0", "F0.1", ...]

An action is F/B/W, the micro-batch, and (several chunks per rank only) ".c", the model chunk on
this rank. Chunk c of rank r is *virtual stage* (piece) k = c*p + r (Narayanan et al. 2021, sec. 2.2):
the model is cut into p*v pieces dealt round-robin, so a micro-batch visits every rank v times. The
V schedules (zbv, dualpipev) place the two chunks of rank r as pieces r and 2p-1-r instead
(`piece_of`): the micro-batch goes down the ranks and comes back up, so rank 0 holds the first and
the last piece. A table entry "F5.0&B1.1" is two actions that run together, an overlapped F&B pair
(DualPipe): the runner posts both receives, then computes one while the other's messages travel.

The schedules (seed 000, sec. 3.4; p stages, m micro-batches):
  gpipe        Huang et al. 2019: every forward, then every backward. Holds all m micro-batches'
               activations at once.
  1f1b         PipeDream-Flush / Megatron (Narayanan et al. 2021, sec. 2.1): stage s warms up with
               min(p-s-1, m) forwards, then alternates one forward, one backward, then cools down.
               Same bubble as GPipe, but at most p-s micro-batches in flight. Any m >= 1.
  interleaved  Narayanan et al. 2021, sec. 2.2: 1F1B over v chunks per rank, micro-batches taken
               p at a time per chunk. Constraint (as Megatron's first version): m a multiple of p.
               The bubble shrinks v times, the p2p traffic grows v times.
  zb-h1        Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 2 (ZB-H1): backward split
               into B (gradient of the stage's input: the previous stage waits for it) and W
               (gradient of the weights: nobody waits for it). B keeps 1F1B's order; each W is
               deferred into what would be idle time, but never beyond p micro-batches in flight
               (F done, W not yet) -- 1F1B's peak memory, that of its first stage.
  interleaved-zb, zbv, dualpipev   the frontier: refimpl.parallel.pp.frontier (their docstrings).

The order is built by replaying the step with unit times (`_list_schedule`): the same replay that
`refimpl.parallel.pp.simulate.simulate` uses to *check* the tables, so a table that deadlocks or
breaks a dependency cannot be produced silently.
"""
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
from refimpl.parallel.pp.frontier import frontier_table, zero_bubble_rows

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
    """The schedule a layout runs: --schedule (a pp-* shorthand sets it: refimpl.registry), else
    1f1b."""
    return cfg.schedule or "1f1b"


def schedule_table(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> list[list[str]]:
    """One list per rank (pipeline stage) of its actions in execution order."""
    check_layout(stages, micro_batches, schedule, virtual_stages)
    p, m, v = stages, micro_batches, virtual_stages
    if schedule == "gpipe":
        orders = [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
                  for _ in range(p)]
    elif schedule == "1f1b":
        orders = [_one_f_one_b(_forwards(m), _backwards(m), min(p - s - 1, m)) for s in range(p)]
    elif schedule == "interleaved":
        orders = [_one_f_one_b(_interleaved(p, m, v, "F"), _interleaved(p, m, v, "B"),
                               min(interleaved_warmup(p, s, v), v * m)) for s in range(p)]
    elif schedule == "zb-h1":     # the interleaved zero-bubble construction on one chunk
        orders = [[entry[0] for entry in row] for row in zero_bubble_rows(p, m, 1)]
    else:
        return frontier_table(p, m, schedule, v)
    return [[a.text(schedule == "interleaved") for a in order] for order in orders]


# --- the bubble, in closed form -------------------------------------------------------------------

def bubble_fraction(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> float:
    """Idle share of the step, (idle time) / (step time), when every micro-batch costs the same.

    gpipe, 1f1b   (p-1) / (m+p-1)      the fill and drain take p-1 slots of F+B (GPipe, sec. 2.2)
    interleaved   (p-1) / (v*m+p-1)    each slot is a chunk, 1/v of a stage (Narayanan 2021, sec 2.2)
    zb-h1         (p-1) / (3m+p-1)     with F = B = W: only p-1 units of one F+B-W remain idle
                                       (Qi et al. 2023, sec. 2.2: bubble (p-1)(F+B-W)).
                                       Needs m >= p: with fewer, the first W cannot start before
                                       the first B returns and the step is longer than this says.
    interleaved-zb (p-1) / (3vm+p-1)   both at once: chunks of 1/v, and F = B = W within each
    zbv           (p-1) / (6m+p-1)     two chunks, F = B = W: as interleaved-zb with v = 2, with 1F1B's
                                       memory (interleaved-zb holds 2p + p - 1 chunks). Needs
                                       m >= 2p - 1, the V's full warm-up; with fewer it is longer.
    dualpipev     p / (6m+p)           one chunk unit per rank more than zbv (p > 1): an overlapped
                                       pair starts when both its inputs are there, so the later one
                                       sets it. DeepSeek's count, (p-1)(F&B + B - 3W), is in units
                                       whose F&B pair is cheaper than F + B: on a GPU the pair hides
                                       its communication, and that is what the overlap buys.
    Each is checked, not restated: tests replay the tables (simulate.simulated_bubble).
    """
    check_layout(stages, micro_batches, schedule, virtual_stages)
    p, m, v = stages, micro_batches, virtual_stages
    if schedule == "dualpipev":
        return p / (6 * m + p) if p > 1 else 0.0
    work = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb-h1": 3 * m, "interleaved-zb": 3 * v * m,
            "zbv": 6 * m}[schedule]
    return (p - 1) / (work + p - 1)


def bubble_over_ideal(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> float:
    """Narayanan et al. 2021's normalisation: bubble time / ideal (bubble-free) time.

    (p-1)/m for gpipe and 1f1b, (p-1)/(v*m) interleaved, (p-1)/(3m) zb-h1. It is f/(1-f) for the
    `bubble_fraction` f above: the same bubble divided by the work instead of by the whole step, so
    it can exceed 1 (p=8, m=4: 1.75 of the ideal, while the step is 64% idle).
    """
    f = bubble_fraction(stages, micro_batches, schedule, virtual_stages)
    return f / (1 - f)
