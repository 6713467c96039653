"""How a launch fails: a rank that failed, named with its traceback, or ranks that ran past the
timeout. (The lab's watch names the rank that failed first by cause: refimpl.launch_tools.)"""
from __future__ import annotations

from pathlib import Path


class RankFailedError(RuntimeError):
    """One rank failed; `rank` says which and `child_traceback` is what it printed."""

    def __init__(self, rank: int, child_traceback: str):
        self.rank = rank
        self.child_traceback = child_traceback
        super().__init__(f"rank {rank} failed:\n{child_traceback}")


class LaunchTimeoutError(TimeoutError):
    """The ranks did not finish within `timeout` seconds; all were killed."""


def failure_text(r, tmp: Path) -> str:
    """What rank `r` left: the traceback refimpl._rank wrote, or, killed before it could write one
    (a signal, an abort in C++), how it ended and the end of its stderr."""
    tb = tmp / f"error{r.rank}.txt"
    if tb.exists():
        return tb.read_text()
    code = r.proc.poll()
    stderr = r.stderr.read_text(errors="replace")[-4000:] if r.stderr.exists() else ""
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return f"rank {r.rank} exited ({how}) without a Python traceback\n{stderr}"
