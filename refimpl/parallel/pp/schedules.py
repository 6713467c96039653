"""Pipeline schedules as data: which forward (F), backward (B) and weight-gradient (W) each stage runs,
in what order. Pure Python: no torch, no process group.

    schedule_table(4, 8, "1f1b")[3]  ->  ["F0", "B0", "F1", "B1", ...]     # the last stage
    schedule_table(2, 4, "interleaved", virtual_stages=2)[0] -> ["F0.0", "F1.0", "F0.1", ...]

An action is F/B/W, the micro-batch, and (interleaved only) ".c", the model chunk on this rank.
Chunk c of rank r is *virtual stage* k = c*p + r (Narayanan et al. 2021, sec. 2.2): the model is cut
into p*v pieces dealt round-robin, so a micro-batch visits every rank v times.

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

The order is built by replaying the step with unit times (`_list_schedule`): the same replay that
`refimpl.parallel.pp.simulate.simulate` uses to *check* the tables, so a table that deadlocks or
breaks a dependency cannot be produced silently.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from refimpl.mesh import LayoutError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
_ACTION = re.compile(r"^(?P<kind>[FBW])(?P<mb>\d+)(?:\.(?P<chunk>\d+))?$")


@dataclass(frozen=True)
class Action:
    kind: str          # "F" forward, "B" backward (input gradient for zb-h1), "W" weight gradient
    micro_batch: int
    chunk: int = 0     # model chunk on this rank (interleaved); virtual stage = chunk * p + rank

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION.match(text)
        if not match:
            raise ValueError(f"not a pipeline action: {text!r} (want e.g. F3, B3, W3, F3.1)")
        return cls(match["kind"], int(match["mb"]), int(match["chunk"] or 0))

    def text(self, chunked: bool) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if chunked else "")


def check_layout(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> None:
    """Raise LayoutError (one line) if this schedule cannot run with these sizes."""
    if schedule not in SCHEDULES:
        raise LayoutError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or micro_batches < 1 or virtual_stages < 1:
        raise LayoutError("pipeline stages, micro-batches and virtual stages must all be >= 1")
    if schedule != "interleaved" and virtual_stages != 1:
        raise LayoutError(f"--virtual-stages {virtual_stages} needs the interleaved schedule")
    if schedule == "interleaved" and micro_batches % stages:
        raise LayoutError(f"interleaved 1F1B needs micro-batches ({micro_batches}) to be a multiple "
                          f"of pipeline stages ({stages})")


SCHEDULE_OF = {"pp-gpipe": "gpipe", "pp-1f1b": "1f1b", "pp-interleaved": "interleaved", "pp-zb": "zb-h1",
               "torch-pp-gpipe": "gpipe", "torch-pp-1f1b": "1f1b", "torch-pp-interleaved": "interleaved"}


def pipeline_schedule(cfg) -> str:
    """The schedule a layout runs: the strategy's own (pp-1f1b, ...), else --schedule, else 1f1b."""
    named = SCHEDULE_OF.get(cfg.strategy)
    chosen = getattr(cfg, "schedule", None)
    if named and chosen and chosen != named:
        raise LayoutError(f"--strategy {cfg.strategy} runs the {named} schedule; drop --schedule {chosen}")
    return named or chosen or "1f1b"


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
        # Warm-up: the ranks after this one, twice (forward there and the gradient back), plus one
        # round of p micro-batches per extra chunk (Megatron's interleaved schedule); v = 1 is 1F1B.
        warmup = [(p - s - 1) * 2 + (v - 1) * p if v > 1 else p - s - 1 for s in range(p)]
        orders = [_one_f_one_b(_interleaved(p, m, v, "F"), _interleaved(p, m, v, "B"),
                               min(warmup[s], v * m)) for s in range(p)]
    else:
        orders = _zero_bubble_h1(p, m)
    return [[a.text(schedule == "interleaved") for a in order] for order in orders]


def _forwards(m):
    return [Action("F", i) for i in range(m)]


def _backwards(m):
    return [Action("B", i) for i in range(m)]


def _one_f_one_b(forwards, backwards, warmup):
    """Megatron's three loops: `warmup` forwards, then one forward + one backward, then cool-down."""
    order = forwards[:warmup]
    for i, fwd in enumerate(forwards[warmup:]):
        order += [fwd, backwards[i]]
    return order + backwards[len(forwards) - warmup:]


def _interleaved(p, m, v, kind):
    """The k-th forward takes chunk (k // p) % v of micro-batch (k // pv) * p + k % p; backwards
    walk the chunks in reverse. Micro-batches go p at a time, so each group fills the pipeline once."""
    actions = []
    for k in range(v * m):
        group, within = divmod(k, p * v)
        chunk = within // p if kind == "F" else v - 1 - within // p
        actions.append(Action(kind, group * p + within % p, chunk))
    return actions


def _zero_bubble_h1(p, m):
    """ZB-H1 by list scheduling with unit F = B = W: each stage keeps 1F1B's F/B order; when its next
    F/B cannot start yet it runs the oldest pending W instead; it must run one first when p
    micro-batches are in flight and the next action is a forward (the memory limit)."""
    fb = [_one_f_one_b(_forwards(m), _backwards(m), min(p - s - 1, m)) for s in range(p)]
    done = {}                                  # (kind, mb, stage) -> time it finished
    orders = [[] for _ in range(p)]
    pending = [[] for _ in range(p)]           # B done, W not yet, oldest first
    t = 0
    while any(fb) or any(pending):
        started = []
        for s in range(p):
            nxt = fb[s][0] if fb[s] else None
            in_flight = sum(a.kind == "F" for a in orders[s]) - sum(a.kind == "W" for a in orders[s])
            must_w = nxt is not None and nxt.kind == "F" and in_flight >= p
            if nxt is not None and not must_w and _ready(nxt, s, p, done, t):
                fb[s].pop(0)
                started.append((s, nxt))
            elif pending[s] and (must_w or nxt is None or not _ready(nxt, s, p, done, t)):
                started.append((s, Action("W", pending[s].pop(0))))
        for s, action in started:
            orders[s].append(action)
            done[(action.kind, action.micro_batch, s)] = t + 1
            if action.kind == "B":
                pending[s].append(action.micro_batch)
        t += 1
        if t > 4 * p * m + 4 * p:  # every action is one unit: a longer replay means a bug here
            raise RuntimeError("zb-h1 construction did not finish")
    return orders


def _ready(action, stage, p, done, t):
    """Can `action` start on `stage` at time t? (a neighbour's result must have finished by t)"""
    mb = action.micro_batch
    if action.kind == "F":
        return stage == 0 or done.get(("F", mb, stage - 1), t + 1) <= t
    if stage == p - 1:
        return done.get(("F", mb, stage), t + 1) <= t
    return done.get(("B", mb, stage + 1), t + 1) <= t


# --- the bubble, in closed form -------------------------------------------------------------------

def bubble_fraction(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> float:
    """Idle share of the step, (idle time) / (step time), when every micro-batch costs the same.

    gpipe, 1f1b   (p-1) / (m+p-1)      the fill and drain take p-1 slots of F+B (GPipe, sec. 2.2)
    interleaved   (p-1) / (v*m+p-1)    each slot is a chunk, 1/v of a stage (Narayanan 2021, sec 2.2)
    zb-h1         (p-1) / (3m+p-1)     with F = B = W: only p-1 units of one F+B-W remain idle
                                       (Qi et al. 2023, sec. 2.2: bubble (p-1)(F+B-W)).
                                       Needs m >= p: with fewer, the first W cannot start before
                                       the first B returns and the step is longer than this says.
    """
    check_layout(stages, micro_batches, schedule, virtual_stages)
    p, m, v = stages, micro_batches, virtual_stages
    work = {"gpipe": m, "1f1b": m, "interleaved": v * m, "zb-h1": 3 * m}[schedule]
    return (p - 1) / (work + p - 1)


def bubble_over_ideal(stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> float:
    """Narayanan et al. 2021's normalisation: bubble time / ideal (bubble-free) time.

    (p-1)/m for gpipe and 1f1b, (p-1)/(v*m) interleaved, (p-1)/(3m) zb-h1. It is f/(1-f) for the
    `bubble_fraction` f above: the same bubble divided by the work instead of by the whole step, so
    it can exceed 1 (p=8, m=4: 1.75 of the ideal, while the step is 64% idle).
    """
    f = bubble_fraction(stages, micro_batches, schedule, virtual_stages)
    return f / (1 - f)
