"""The runs under a TensorBoard logdir, and their traces loaded once.

A run is a folder holding `rank<r>.<id>.pt.trace.json[.gz]` files (what `StepProfiler` writes).
Parsing a rank's trace costs about 0.2 s per 6 MB of JSON on a laptop core, so a viewer must not do
it on every request: `RunCache` keeps each run's labelled ranges (a small DataFrame) and reloads a
run only when one of its trace files changed. `warm()` imports what the routes need and loads every
run in a background thread, so that by the time a learner clicks the tab the first page is cheap.
"""
from __future__ import annotations

import os
import re
import threading
from pathlib import Path

TRACE_FILE = re.compile(r"^rank\d+\..*\.pt\.trace\.json(\.gz)?$")


def find_runs(logdir: Path) -> list[Path]:
    """Every folder under `logdir` (itself included) that holds at least one rank trace."""
    runs = []
    for folder, dirs, files in os.walk(logdir):
        dirs.sort()
        if any(TRACE_FILE.match(f) for f in files):
            runs.append(Path(folder))
    return runs


def _signature(run: Path) -> tuple:
    """Changes whenever a trace file is added, removed or rewritten."""
    sig = []
    for path in sorted(run.iterdir()):
        if TRACE_FILE.match(path.name):
            st = path.stat()
            sig.append((path.name, st.st_mtime_ns, st.st_size))
    return tuple(sig)


class RunCache:
    """run folder -> its `load_trace` DataFrame, reloaded only when its trace files change."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self._lock = threading.Lock()                        # guards _run_locks and _warming
        self._run_locks: dict[Path, threading.Lock] = {}
        self._frames: dict[Path, tuple[tuple, object]] = {}  # run -> (signature, DataFrame);
                                                             # an entry is guarded by its run lock
        self._warming: threading.Thread | None = None

    def resolve(self, label: str) -> Path:
        """A run's label (its path relative to the logdir) -> its folder, never one outside."""
        run = (self.logdir / label).resolve()
        if not run.is_relative_to(self.logdir.resolve()) or not run.is_dir():
            raise KeyError(label)
        if not any(TRACE_FILE.match(p.name) for p in run.iterdir()):
            raise KeyError(label)
        return run

    def frame(self, run: Path):
        """The run's labelled ranges (see refimpl.lab.trace.profiling.load_trace).

        A page asks four routes of the same run at once, and the warm-up thread may be loading it
        too: one lock per run makes them all wait for a single parse instead of doing four.
        """
        from refimpl.lab.trace.profiling import load_trace

        with self._lock:
            run_lock = self._run_locks.setdefault(run, threading.Lock())
        with run_lock:
            sig = _signature(run)
            cached = self._frames.get(run)
            if cached is None or cached[0] != sig:
                cached = (sig, load_trace(run))
                self._frames[run] = cached
        return cached[1]

    def warm(self) -> None:
        """Load every run not yet cached, in a background thread (at most one at a time)."""
        with self._lock:
            if self._warming is not None and self._warming.is_alive():
                return
            self._warming = threading.Thread(target=self._load_all, name="refimpl-trace-warm",
                                             daemon=True)
            self._warming.start()

    def _load_all(self) -> None:
        # What the routes import costs seconds too (pandas, torch, plotly for the palette).
        import refimpl.lab.plots  # noqa: F401
        import refimpl.lab.trace.views  # noqa: F401

        for run in find_runs(self.logdir):
            try:
                self.frame(run.resolve())
            except Exception:   # a half-written trace: it will load on request, or next time
                pass
