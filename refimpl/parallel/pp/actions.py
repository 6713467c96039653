"""The words a schedule table is written in: actions, overlapped pairs, and where each chunk lives.

    Action.parse("F3.1") -> Action("F", 3, 1)        parse_entry("F5.0&B1.1") -> [F5.0, B1.1]
    piece_of(rank=1, chunk=1, p=4)          -> 5     round-robin (Narayanan et al. 2021): c*p + r
    piece_of(rank=1, chunk=1, p=4, "v")     -> 6     the V (zbv, dualpipev): r and 2p-1-r

Pure Python, shared by schedules.py (the classic tables) and frontier.py (the new ones).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

V_SCHEDULES = ("zbv", "dualpipev")            # two chunks per rank, placed as a V
SPLIT_SCHEDULES = ("zb-h1", "interleaved-zb", "zbv", "dualpipev")   # B/W split: tables have W's
_ACTION = re.compile(r"^(?P<kind>[FBW])(?P<mb>\d+)(?:\.(?P<chunk>\d+))?$")
PAIR = "&"                                    # "F5.0&B1.1": an overlapped F&B pair, one table entry


def placement(schedule: str) -> str:
    """"v" for the V schedules, "loop" (round-robin) for the rest."""
    return "v" if schedule in V_SCHEDULES else "loop"


def chunks_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    return 2 if schedule in V_SCHEDULES else virtual_stages


def piece_of(rank: int, chunk: int, p: int, where: str = "loop") -> int:
    """The piece (virtual stage) that chunk `chunk` of `rank` is: c*p + r, or on a V r / 2p-1-r."""
    if where == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def rank_of(piece: int, p: int, where: str = "loop") -> int:
    """The rank that holds `piece` (the inverse of piece_of, up to the chunk)."""
    if where == "v":
        return piece if piece < p else 2 * p - 1 - piece
    return piece % p


def parse_entry(text: str) -> list["Action"]:
    """A table entry: one action, or an overlapped pair "F5.0&B1.1" (forward first)."""
    return [Action.parse(t) for t in text.split(PAIR)]


def flat(row: list[str]) -> list[str]:
    """A row with its pairs split into their actions, in the order the runner computes them."""
    return [t for entry in row for t in entry.split(PAIR)]


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


def _forwards(m):
    return [Action("F", i) for i in range(m)]


def _backwards(m):
    return [Action("B", i) for i in range(m)]


def interleaved_warmup(p: int, stage: int, v: int) -> int:
    """Forwards a rank runs before its first backward: the ranks after it, twice (the forward there
    and the gradient back), plus one round of p micro-batches per extra chunk (Megatron's
    interleaved schedule); v = 1 is 1F1B's p - stage - 1."""
    return (p - stage - 1) * 2 + (v - 1) * p if v > 1 else p - stage - 1


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


