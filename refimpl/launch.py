"""Start `world_size` ranks, run one function on each, and hand back every rank's result.

    results = run(fn, 2, x, backend="auto")      # -> [fn(0, 2, x), fn(1, 2, x)]"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import cloudpickle
import torch.distributed as dist

from refimpl.launch_tools import tools
from refimpl.process_group import CHILD_MARK as _CHILD_MARK
from refimpl.process_group import (  # noqa: F401  (the rank's side, re-exported)
    device_for,
    init_process_group,
    pick_backend,
    run_this_torchrun_rank,
    under_torchrun,
)


class RankFailedError(RuntimeError):
    """One rank failed; `rank` says which and `child_traceback` is what it printed."""

    def __init__(self, rank: int, child_traceback: str):
        self.rank = rank
        self.child_traceback = child_traceback
        super().__init__(f"rank {rank} failed:\n{child_traceback}")


class LaunchTimeoutError(TimeoutError):
    """The ranks did not finish within `timeout` seconds; all were killed."""


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    stdout: Path
    stderr: Path


def run(fn: Callable[..., Any], world_size: int = 2, *args, backend: str = "auto",
        timeout: float = 600.0, quiet: bool = False, **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return results in rank order."""
    if under_torchrun():
        return [run_this_torchrun_rank(fn, args, kwargs, backend, timeout)]
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")

    backend = pick_backend(world_size, backend)
    # The caller hosts the store; port=0 lets the OS choose a free port, so launches never collide.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="refimpl-run-") as tmp:
        tmp = Path(tmp)
        payload = tmp / "payload.pkl"
        payload.write_bytes(cloudpickle.dumps({"fn": fn, "args": args, "kwargs": kwargs}))
        payload.with_suffix(".path.json").write_text(json.dumps(sys.path))
        watch = tools().watch(tmp, backend)     # e.g. the lab's hang report
        ranks = [_start_rank(r, world_size, backend, store.port, payload, tmp, timeout, watch)
                 for r in range(world_size)]
        try:
            (watch.wait if watch is not None else wait_all)(ranks, tmp, timeout)
        finally:
            _kill_all(ranks)  # no-op for ranks that already exited
            if not quiet:
                _echo_output(ranks)
        return [cloudpickle.loads((tmp / f"result{r}.pkl").read_bytes()) for r in range(world_size)]


def _start_rank(rank: int, world_size: int, backend: str, port: int, payload: Path, tmp: Path,
                timeout: float, watch=None) -> _Rank:
    env = dict(os.environ)
    env.update({
        _CHILD_MARK: "1",
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "REFIMPL_BACKEND": backend, "REFIMPL_TIMEOUT": str(timeout),
        "REFIMPL_PAYLOAD": str(payload), "REFIMPL_OUTDIR": str(tmp),
    })
    tools().rank_env(env, backend, watch)
    if backend == "gloo":
        # One thread per CPU rank, set before the child imports torch (4 ranks ran 12x slower).
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    out, err = tmp / f"stdout{rank}.txt", tmp / f"stderr{rank}.txt"
    starter = tools().starter(backend)
    if starter is not None:      # e.g. forked from a warm interpreter: torch already imported
        return _Rank(rank, starter.start(env, out, err), out, err)
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen([sys.executable, "-m", "refimpl._rank"], env=env, stdout=fo,
                                stderr=fe, stdin=subprocess.DEVNULL, start_new_session=True)
    return _Rank(rank, proc, out, err)


def wait_all(ranks: list[_Rank], tmp: Path, timeout: float) -> None:
    """Until every rank has exited 0: a rank that failed raises RankFailedError with what it
    left, and ranks still running at `timeout` raise LaunchTimeoutError (the caller kills them)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [r.proc.poll() for r in ranks]
        for r, code in zip(ranks, codes):
            if code not in (None, 0):
                raise RankFailedError(r.rank, failure_text(r, tmp))
        running = [r.rank for r, code in zip(ranks, codes) if code is None]
        if not running:
            return
        if time.monotonic() > deadline:
            raise LaunchTimeoutError(f"ranks {running} still running after {timeout:.0f} s; "
                                     f"killed all {len(ranks)} ranks")
        time.sleep(0.02)


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


def _kill_all(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.proc.poll() is not None:
            continue
        if not isinstance(r.proc, subprocess.Popen):   # a starter's: it kills, it knows the pid
            r.proc.kill_group()
        else:   # the rank's whole session: it may have started helpers of its own (a Popen child
            # not yet waited for keeps its pid, so this cannot hit another process)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGKILL)
    for r in ranks:
        r.proc.wait()


def _echo_output(ranks: list[_Rank]) -> None:
    for r in ranks:
        text = r.stdout.read_text(errors="replace") if r.stdout.exists() else ""
        for line in text.splitlines():
            print(f"[rank {r.rank}] {line}")


