"""Keep torch.profiler's native chatter out of a notebook's output, and nothing else.

Kineto prints `USDT:... profiler_start` / `profiler_stop` to file descriptor 2 each time a profiler
starts or stops, and c10 warns "Memory block of unknown size was allocated before the profiling
started" when a tensor older than the profiler is freed. No environment variable or Python API
silences them once torch is loaded, and in a Jupyter kernel every such line becomes a red stderr
block in the executed page. `filtered_native_stderr` routes fd 2 through a pipe for the duration
of a `with` block; a thread forwards every line that is not one of those at once, to the original
fd 2, so real warnings and errors still appear.
"""
from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager

from refimpl.lab.progress import in_notebook

PROFILER_CHATTER = re.compile(
    r"SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)"
    r"|Memory block of unknown size was allocated before the profiling started")


@contextmanager
def filtered_native_stderr(pattern: re.Pattern = PROFILER_CHATTER):
    """Inside the block, lines written to fd 2 that match `pattern` are dropped, the rest kept."""
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump():
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                if not pattern.search(line.decode(errors="replace")):
                    os.write(saved, line)

    forwarder = threading.Thread(target=pump, daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        os.dup2(saved, 2)          # the pipe's last writer goes away: the forwarder sees EOF
        forwarder.join(timeout=5)
        os.close(saved)


@contextmanager
def quiet_profiler_in_notebook():
    """`filtered_native_stderr` in a Jupyter kernel; nothing changes anywhere else."""
    if not in_notebook():
        yield
        return
    with filtered_native_stderr():
        yield
