"""Start `world_size` ranks, run one function on each, and hand back every rank's result.

    results = run(fn, 2, x, backend="auto")      # -> [fn(0, 2, x), fn(1, 2, x)]

The function is shipped with cloudpickle (a notebook cell's function works); each CPU rank gets
OMP_NUM_THREADS=1 before it imports torch; NCCL when every rank has a GPU, gloo otherwise; a rank
that raises makes `run` raise RankFailedError naming it, with its traceback; a hang ends at
`timeout` with every rank killed. Under torchrun `run` calls `fn` for this rank only. What the
lab adds (the zygote, the flight recorder's hang report) comes through refimpl.launch_tools.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import cloudpickle

from refimpl.host_heap import heap_policy
from refimpl.launch_tools import tools

# Set on every child we start, so a nested `run` inside a rank is not mistaken for torchrun.
_CHILD_MARK = "REFIMPL_RANK_CHILD"


class RankFailedError(RuntimeError):
    """One rank raised; `rank` says which and `child_traceback` is what it printed. `others`: the
    other ranks that had also failed by then, each with how ("traceback", "killed by signal 9",
    "exit code 1"): the consequences the launcher did not name. `exit_order`: the ranks that had
    exited, in the order the launcher saw them go (the named rank need not be the first)."""

    def __init__(self, rank: int, child_traceback: str, others: dict | None = None,
                 exit_order: list[int] | None = None):
        self.rank = rank
        self.child_traceback = child_traceback
        self.others = others or {}
        self.exit_order = exit_order or []   # the ranks in the order the launcher saw them exit
        super().__init__(f"rank {rank} failed:\n{child_traceback}")


class LaunchTimeoutError(TimeoutError):
    """The ranks did not finish within `timeout` seconds; all were killed."""


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    stdout: Path
    stderr: Path


def pick_backend(world_size: int, backend: str = "auto") -> str:
    """NCCL only when every rank can have a GPU of its own; gloo (CPU) otherwise."""
    if backend != "auto":
        return backend
    if os.environ.get("REFIMPL_SHARED_DEVICE"):     # several ranks on one device (shared_device)
        return "staged"
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and _CHILD_MARK not in os.environ


def run(fn: Callable[..., Any], world_size: int = 2, *args, backend: str = "auto",
        timeout: float = 600.0, quiet: bool = False, flight_recorder_on: bool | None = None,
        stall: float | None = None, **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return results in rank order.

    `quiet=True` drops what the ranks printed; otherwise it is echoed after they finish, each
    line prefixed with its rank. `flight_recorder_on`: record each rank's communication calls for
    the hang report (default: on, unless REFIMPL_FLIGHT_RECORDER=0 in this environment).
    `stall` (seconds; needs the flight recorder): call it a hang as soon as every running rank has
    waited that long inside the same communication call, without waiting for `timeout` (on NCCL,
    where a call returns once posted: since the same last posted call).
    """
    if under_torchrun():
        return [_run_this_torchrun_rank(fn, args, kwargs, backend, timeout)]
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if stall is not None and (stall <= 0 or flight_recorder_on is False):
        raise ValueError("stall needs a positive number of seconds and the flight recorder on")

    import torch.distributed as dist

    backend = pick_backend(world_size, backend)
    # The caller hosts the store; port=0 lets the OS choose a free port, so launches never collide.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=_timedelta(timeout))
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


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


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
    waiting, since, next_look = None, 0.0, 0.0
    while pending:
        for rank, r in list(pending.items()):
            code = r.proc.poll()
            if code is None:
                continue
            del pending[rank]
            exited.append(rank)
            if code != 0:
                _wait_for_the_rest(ranks, exited)
                first = _first_failure(ranks, tmp, default=r)
                others = {x.rank: _how_it_failed(x, tmp) for x in ranks
                          if x is not first and x.proc.poll() not in (None, 0)}
                text = _failure_text(first, tmp, first.proc.poll())
                if posted and watch is not None:   # NCCL's watchdog ended a hung collective
                    text += "\n" + watch.report([x.rank for x in ranks], posted)
                raise RankFailedError(first.rank, text, others, exit_order=exited)
        now = time.monotonic()
        if stall is not None and now >= next_look:
            next_look = now + 0.25            # a look reads each running rank's 16 KiB ring
            calls = watch.waiting(sorted(pending), posted)
            if calls != waiting:              # someone moved on (or not everyone waits yet)
                waiting, since = calls, now
            elif calls is not None and now - since >= stall:
                waited = "after the same posted" if posted else "in the same communication"
                raise LaunchTimeoutError(
                    f"ranks {sorted(pending)} each waited {stall:g} s {waited} call; killed all "
                    f"{len(ranks)} ranks\n" + watch.report(sorted(pending), posted))
        if now > deadline:
            where = "\n" + watch.report(sorted(pending), posted) if watch is not None else ""
            raise LaunchTimeoutError(
                f"ranks {sorted(pending)} still running after {timeout:.0f} s; killed all "
                f"{len(ranks)} ranks{where}")
        time.sleep(0.02)


def _wait_for_the_rest(ranks: list[_Rank], exited: list[int], grace: float = 3.0) -> None:
    """After a rank failed: up to `grace` seconds for every other rank to exit too, each appended
    to `exited` as it goes. The cause is not always the first to exit: a node whose network went
    first, then the node itself, leaves its peers failing on the closed connection before it is
    killed; a fixed wait of 1 s named a peer whenever the death came later than that. Peers that fail at once end the wait at once."""
    deadline = time.monotonic() + grace
    while len(exited) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.02)
        exited.extend(r.rank for r in ranks if r.rank not in exited and r.proc.poll() is not None)


def _first_failure(ranks: list[_Rank], tmp: Path, default: _Rank) -> _Rank:
    """The rank that failed first by cause, not merely the first one polled or the first to exit.

    When one rank dies, its peers soon fail too ("connection closed by peer"); the root cause is
    the earliest traceback (the others had _wait_for_the_rest to write theirs) -- unless a rank
    was killed by a signal (the OOM killer, a lost device, kill -9): it wrote no traceback, and the
    peers' tracebacks are its consequence, whether they came before its death or after.
    """
    # A rank killed by a signal (kill -9, the OOM killer, a segfault) leaves no traceback, and its
    # peers' "connection closed" tracebacks come after its death: it is the cause. (Nothing of
    # ours has signalled any rank yet: _kill_all runs after this.)
    signalled = [r for r in ranks if (r.proc.poll() or 0) < 0
                 and not (tmp / f"error{r.rank}.txt").exists()]
    if signalled:
        return signalled[0]
    written = [(os.stat(tmp / f"error{r.rank}.txt").st_mtime_ns, r.rank) for r in ranks
               if (tmp / f"error{r.rank}.txt").exists()]
    if not written:
        return default
    return ranks[min(written)[1]]


def _how_it_failed(r: _Rank, tmp: Path) -> str:
    if (tmp / f"error{r.rank}.txt").exists():
        return "traceback"
    code = r.proc.poll()
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _failure_text(r: _Rank, tmp: Path, code: int) -> str:
    tb = tmp / f"error{r.rank}.txt"
    if tb.exists():
        return tb.read_text()
    stderr = r.stderr.read_text(errors="replace")[-4000:] if r.stderr.exists() else ""
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return f"rank {r.rank} exited ({how}) without a Python traceback\n{stderr}"


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


def _run_this_torchrun_rank(fn, args, kwargs, backend: str, timeout: float):
    """Under torchrun every process calls `run`; each runs `fn` once, for its own rank, on the
    backend asked for (gloo for a run kept on the CPU) and with the caller's `timeout` for its
    process group: torchrun has no watchdog of ours, so the group's is the one that ends a hang."""
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    created = not dist.is_initialized()
    if created:
        heap_policy()           # as our own ranks' (refimpl.host_heap): big blocks go back when freed
        # Multi-node: each node needs a GPU per *local* rank, not per rank of the whole world.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        chosen = pick_backend(local, backend)
        if backend == "auto" and chosen == "gloo" and os.environ.get("LOCAL_RANK", "0") == "0":
            import torch

            why = gloo_fallback_warning(local, torch.cuda.device_count() if torch.cuda.is_available()
                                        else 0, os.environ)
            if why:
                print(why, file=sys.stderr, flush=True)
        init_process_group(rank, world_size, chosen, timeout=timeout)
    try:
        return fn(rank, world_size, *args, **kwargs)
    finally:
        if created:
            # As refimpl._rank does: free the strategies' reference cycles (hooks, pending work,
            # the process groups they hold) now, while the interpreter is whole. Left to its
            # finalization, a gloo thread releasing the last reference to a tensor needs the GIL
            # there, and a thread refused the GIL at exit ends the process with SIGABRT.
            gc.collect()
            dist.destroy_process_group()


def gloo_fallback_warning(local_ranks: int, gpus: int, env) -> str | None:
    """One line for a torchrun whose ranks see GPUs, but fewer than one each: NCCL needs a GPU per
    rank, so they run on gloo (CPU). Under Slurm the usual cause is a task bound to one GPU
    (--gpus-per-task 1, or a CUDA_VISIBLE_DEVICES per task) while torchrun starts a rank per GPU
    of the node. None where there is no GPU (gloo is the plan) or one per rank."""
    if gpus == 0 or gpus >= local_ranks:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    slurm = (f"; Slurm job {env['SLURM_JOB_ID']}: give each torchrun all its node's GPUs "
             "(--gpus-per-node), not one per task") if env.get("SLURM_JOB_ID") else ""
    return (f"refimpl: warning: {local_ranks} ranks on this node but this process sees {gpus} "
            f"GPU{'s' if gpus != 1 else ''}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
            + f": NCCL needs one GPU per rank, so the ranks run on gloo (CPU){slurm} "
            "(--device cpu where gloo is meant)")


def process_group_kwargs(backend: str, local_rank: int, torch_version: str | None = None) -> dict:
    """init_process_group's extra arguments for this rank: `device_id` (the rank's GPU) for NCCL
    ranks where torch takes it (>= 2.3), nothing on CPU (gloo) and the other backends.

    Why: without it NCCL creates each communicator lazily, at the group's first collective, which
    for the data-parallel group is inside a backward hook, on autograd's thread, timed as
    backward; with it the world's communicator is made here, at once (a bad GPU or network fails
    at start-up, not in step 1), and new_group splits the others from it."""
    import torch

    if backend != "nccl":
        return {}
    version = torch.torch_version.TorchVersion(torch_version or torch.__version__)
    if version < (2, 3):
        return {}
    return {"device_id": torch.device("cuda", local_rank)}


# How much sooner than the launcher an NCCL group times out: a quarter of the launch's time, at
# most this many seconds (`group_timeout`).
NCCL_TIMEOUT_MARGIN_S = 60.0


def group_timeout(timeout: float, backend: str) -> float:
    """The process group's timeout in a launch that gives up after `timeout` seconds. On NCCL
    shorter, by a quarter of it and at most NCCL_TIMEOUT_MARGIN_S: a hung NCCL collective returned
    when it was posted, so the launcher's stall watchdog may never see it, but NCCL's own
    watchdog times it out, dumps its flight recorder and ends the rank while the launcher still
    waits; with equal timeouts the launcher killed the ranks first. gloo's ranks block inside the
    call, where the launcher's report finds them: its group keeps the launcher's timeout."""
    if backend != "nccl":
        return timeout
    return timeout - min(NCCL_TIMEOUT_MARGIN_S, timeout / 4)


def init_process_group(rank: int, world_size: int, backend: str, timeout: float = 600.0) -> None:
    """Join the default process group via MASTER_ADDR/MASTER_PORT; bind a GPU under NCCL."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    # run()'s children: below the launcher's timeout on NCCL; torchrun's: the one asked for
    group_wait = _timedelta(group_timeout(timeout, backend) if _CHILD_MARK in os.environ
                            else timeout)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    tools().joining(backend, launched=_CHILD_MARK in os.environ)   # e.g. the staged backend
    extra = process_group_kwargs(backend, local_rank)
    if _CHILD_MARK in os.environ:
        # Our own child: join the store the caller hosts (it counts as one extra client).
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              world_size + 1, is_master=False, timeout=_timedelta(timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=group_wait, **extra)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun, whose agent hosts the store: the c10d rendezvous keeps ONE store for every
        # restart of the job, and env:// puts the ranks' keys (gloo's listening addresses, NCCL's
        # unique id) under the same names each attempt. A restarted rank could then read a dead
        # peer's address and wait on it until the timeout (seen: 2 restarts in 5 hung). The
        # attempt's number in front of every key keeps each attempt to its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              world_size, is_master=False, timeout=_timedelta(timeout))
        dist.init_process_group(backend, store=dist.PrefixStore(f"refimpl/attempt{attempt}", store),
                                rank=rank, world_size=world_size, timeout=group_wait, **extra)
    else:  # torchrun without an agent store: env:// (rank 0 hosts a fresh store each attempt)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=group_wait,
                                **extra)


def device_for(backend: str):
    """The device this rank computes on: its own GPU under NCCL, the CPU under gloo, the shared
    device under the staged backend, `meta` under the dry run's fake one."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "staged":     # every rank on the one shared device (refimpl.lab.runtime.shared_device)
        return torch.device(os.environ.get("REFIMPL_SHARED_DEVICE", "cpu"))
    if backend == "fake":       # the dry run (refimpl.lab.verify.dryrun): shapes only, no storage
        return torch.device("meta")
    return torch.device("cpu")
