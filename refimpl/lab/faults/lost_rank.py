"""The fault `rank-dies`: a rank lost as a node is lost, its links first, then the process."""
from __future__ import annotations

import os
import signal
import socket
import stat
import time
from pathlib import Path


def lose_this_rank(rank: int, world_size: int, linger_s: float = 1.5, wait_s: float = 60.0) -> None:
    """The `rank-dies` fault, as a node is lost: its links first, then the process.

    Every socket of the rank is shut down (as a dead NIC would leave them: destroying the process
    group is not enough, the strategy's subgroups keep their connections open), so each peer's
    next collective fails on a closed connection and the peer exits with a traceback; once every peer's traceback is written (the launcher's
    REFIMPL_OUTDIR; at most `wait_s`), and `linger_s` later, the rank is killed by SIGKILL (the
    OOM killer, a dead node), writing none. It is then the last rank to exit, not the first, and
    the launcher must still name it: the cause, not the first exit (refimpl.launch)."""
    for fd in (int(name) for name in os.listdir("/proc/self/fd")):
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                with socket.socket(fileno=os.dup(fd)) as link:
                    link.getpeername()      # connected ones only: a listener's death aborts gloo
                    link.shutdown(socket.SHUT_RDWR)
        except OSError:     # gone already, or not a connected socket
            pass
    outdir = os.environ.get("REFIMPL_OUTDIR")
    peers = [Path(outdir, f"error{r}.txt") for r in range(world_size) if r != rank] if outdir else []
    deadline = time.monotonic() + wait_s
    while not all(p.exists() for p in peers) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(linger_s)
    os.kill(os.getpid(), signal.SIGKILL)
