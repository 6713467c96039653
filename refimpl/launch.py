"""Start `world_size` ranks, run one function on each, and hand back every rank's result.

    results = run(fn, 2, x, backend="auto")      # -> [fn(0, 2, x), fn(1, 2, x)]"""
from __future__ import annotations

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

from refimpl.launch_tools import tools
from refimpl.process_group import CHILD_MARK as _CHILD_MARK
from refimpl.process_group import (  # noqa: F401  (the rank's side, re-exported)
    device_for,
    gloo_fallback_warning,
    init_process_group,
    pick_backend,
    process_group_kwargs,
    run_this_torchrun_rank,
    under_torchrun,
)
from refimpl.rank_failures import LaunchTimeoutError, RankFailedError, rank_failed  # noqa: F401


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    stdout: Path
    stderr: Path


def run(fn: Callable[..., Any], world_size: int = 2, *args, backend: str = "auto",
        timeout: float = 600.0, quiet: bool = False, flight_recorder_on: bool | None = None,
        stall: float | None = None, **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return results in rank order.
    """
    if under_torchrun():
        return [run_this_torchrun_rank(fn, args, kwargs, backend, timeout)]
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if stall is not None and (stall <= 0 or flight_recorder_on is False):
        raise ValueError("stall needs a positive number of seconds and the flight recorder on")

    import torch.distributed as dist

    backend = pick_backend(world_size, backend)
    # The caller hosts the store; port=0 lets the OS choose a free port, so launches never collide.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="refimpl-run-") as tmp:
        tmp = Path(tmp)
        payload = tmp / "payload.pkl"
        payload.write_bytes(cloudpickle.dumps({"fn": fn, "args": args, "kwargs": kwargs}))
        payload.with_suffix(".path.json").write_text(json.dumps(sys.path))
        watch = tools().watch(tmp / "flight", flight_recorder_on)   # the hang report's, or None
        if stall is not None and watch is None:
            raise ValueError("stall needs a watch on the ranks' calls (the lab's flight recorder)")
        ranks = [_start_rank(r, world_size, backend, store.port, payload, tmp, timeout, watch)
                 for r in range(world_size)]
        try:
            _wait_all(ranks, tmp, timeout, watch, stall, backend)
        finally:
            _kill_all(ranks)  # no-op for ranks that already exited
            if not quiet:
                _echo_output(ranks)
        results = [cloudpickle.loads((tmp / f"result{r}.pkl").read_bytes()) for r in range(world_size)]
    del store
    return results


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
    if backend == "nccl":
        # cuBLAS's deterministic mode needs a fixed workspace, set before cuBLAS starts
        # (refimpl.numerics).
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if backend in ("gloo", "staged"):
        # One thread per CPU rank, set before the child imports torch (see module docstring).
        env["OMP_NUM_THREADS"] = "1"
        env["MKL_NUM_THREADS"] = "1"
        # All ranks are on this host: keep gloo's connections on loopback instead of whatever
        # interface the hostname resolves to.
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out, err = tmp / f"stdout{rank}.txt", tmp / f"stderr{rank}.txt"
    starter = tools().starter(backend)
    if starter is not None:      # e.g. forked from a warm interpreter: torch already imported
        return _Rank(rank, starter.start(env, out, err), out, err)
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen([sys.executable, "-m", "refimpl._rank"], env=env, stdout=fo,
                                stderr=fe, stdin=subprocess.DEVNULL, start_new_session=True)
    return _Rank(rank, proc, out, err)


def _wait_all(ranks: list[_Rank], tmp: Path, timeout: float, watch=None,
              stall: float | None = None, backend: str = "gloo") -> None:
    deadline = time.monotonic() + timeout
    posted = backend == "nccl"       # an NCCL call returns once posted, and waits after it
    pending = {r.rank: r for r in ranks}
    exited: list[int] = []
    while pending:
        for rank, r in list(pending.items()):
            code = r.proc.poll()
            if code is None:
                continue
            del pending[rank]
            exited.append(rank)
            if code != 0:
                # on NCCL the watchdog ended a hung collective: where each rank had posted
                hung = watch.report([x.rank for x in ranks], posted) if posted and watch else ""
                raise rank_failed(ranks, tmp, r, exited, hung)
        hang = watch.stalled(sorted(pending), posted, stall) if stall is not None else None
        if hang is None and time.monotonic() > deadline:
            hang = f"ranks {sorted(pending)} still running after {timeout:.0f} s"
        if hang is not None:
            where = "\n" + watch.report(sorted(pending), posted) if watch is not None else ""
            raise LaunchTimeoutError(f"{hang}; killed all {len(ranks)} ranks{where}")
        time.sleep(0.02)


def _kill_all(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            if not isinstance(r.proc, subprocess.Popen):   # a starter's: it kills, it knows the pid
                r.proc.kill_group()
                continue
            try:  # the rank's whole session: it may have started helpers of its own (a Popen
                # child not yet waited for keeps its pid, so this cannot hit another process)
                os.killpg(r.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for r in ranks:
        r.proc.wait()


def _echo_output(ranks: list[_Rank]) -> None:
    for r in ranks:
        text = r.stdout.read_text(errors="replace") if r.stdout.exists() else ""
        for line in text.splitlines():
            print(f"[rank {r.rank}] {line}")


