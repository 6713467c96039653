"""Which rank failed first by cause (the lab's watch on a launch, refimpl.lab.runtime.watch): the
launcher names it, with its traceback, and the others that failed in its wake."""
from __future__ import annotations

import os
import time
from pathlib import Path

from refimpl.launch import RankFailedError, failure_text


class RankFailedAmongOthers(RankFailedError):
    """RankFailedError, with what else the launcher saw. `others`: the other ranks that had also
    failed by then, each with how ("traceback", "killed by signal 9", "exit code 1"): the
    consequences the launcher did not name. `exit_order`: the ranks that had exited, in the order
    the launcher saw them go (the named rank need not be the first)."""

    def __init__(self, rank: int, child_traceback: str, others: dict, exit_order: list[int]):
        super().__init__(rank, child_traceback)
        self.others = others
        self.exit_order = exit_order


def rank_failed(ranks, tmp: Path, r, exited: list[int], note: str = "") -> RankFailedAmongOthers:
    """The error for a launch in which rank `r` exited non-zero; `exited` grows as the others go."""
    _wait_for_the_rest(ranks, exited)
    first = _first_failure(ranks, tmp, default=r)
    others = {x.rank: _how_it_failed(x, tmp) for x in ranks
              if x is not first and x.proc.poll() not in (None, 0)}
    text = failure_text(first, tmp) + (f"\n{note}" if note else "")
    return RankFailedAmongOthers(first.rank, text, others, exit_order=exited)


def _wait_for_the_rest(ranks: list, exited: list[int], grace: float = 3.0) -> None:
    """After a rank failed: up to `grace` seconds for every other rank to exit too, each appended
    to `exited` as it goes. The cause is not always the first to exit: a node whose network went
    first, then the node itself, leaves its peers failing on the closed connection before it is
    killed; a fixed wait of 1 s named a peer whenever the death came later than that. Peers that
    fail at once end the wait at once."""
    deadline = time.monotonic() + grace
    while len(exited) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.02)
        exited.extend(r.rank for r in ranks if r.rank not in exited and r.proc.poll() is not None)


def _first_failure(ranks: list, tmp: Path, default):
    """The rank that failed first by cause, not merely the first one polled or the first to exit.

    When one rank dies, its peers soon fail too ("connection closed by peer"); the root cause is
    the earliest traceback (the others had _wait_for_the_rest to write theirs) -- unless a rank
    was killed by a signal (the OOM killer, a lost device, kill -9): it wrote no traceback, and the
    peers' tracebacks are its consequence, whether they came before its death or after.
    """
    # A rank killed by a signal (kill -9, the OOM killer, a segfault) leaves no traceback, and its
    # peers' "connection closed" tracebacks come after its death: it is the cause. (Nothing of
    # ours has signalled any rank yet: the launcher kills after this.)
    signalled = [r for r in ranks if (r.proc.poll() or 0) < 0
                 and not (tmp / f"error{r.rank}.txt").exists()]
    if signalled:
        return signalled[0]
    written = [(os.stat(tmp / f"error{r.rank}.txt").st_mtime_ns, r.rank) for r in ranks
               if (tmp / f"error{r.rank}.txt").exists()]
    if not written:
        return default
    return ranks[min(written)[1]]


def _how_it_failed(r, tmp: Path) -> str:
    if (tmp / f"error{r.rank}.txt").exists():
        return "traceback"
    code = r.proc.poll()
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
