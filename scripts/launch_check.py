"""The CLI under torchrun as a scheduler runs it: clean exits, and a job that survives a lost rank.

    python scripts/launch_check.py                  # make launch-check: all three, 15-25 min on 2 cores
    python scripts/launch_check.py exits --runs 3   # a part, fewer runs
    python scripts/launch_check.py restart          # (or exits-plain, exits-profile)

exits     2 torchrun agents x 2 ranks with the c10d rendezvous on localhost (two nodes, as a Slurm
          job runs them): the CLI --runs times in a row, with and without --profile; every run must
          exit 0 on both agents (a scheduler marks a non-zero exit FAILED and may retry the job)
          and print the losses of `single`.
restart   torchrun --max-restarts 1: once the first checkpoint is on disk, rank 1 is killed with
          SIGKILL; torchrun restarts the job, which resumes from the newest checkpoint
          (--checkpoint-dir) and ends with the losses and weights of `single`'s uninterrupted run.

Everything runs in float64, so "equal" is the workbook's 1e-9 gate (refimpl.lab.verify.equivalence).
Every torchrun starts in its own session and is killed with it on a timeout: nothing outlives this.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]   # torchrun, from this interpreter
GATE = 1e-9
MODEL = ["--layers", "2", "--d-model", "64", "--heads", "4", "--dtype", "float64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def start(args: list[str], out: Path) -> subprocess.Popen:
    with open(out.with_suffix(".out"), "wb") as fo, open(out.with_suffix(".err"), "wb") as fe:
        return subprocess.Popen(TORCHRUN + args, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                env=environment(), cwd=REPO, start_new_session=True)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun starts each rank in a session of its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes; on a timeout every agent and its ranks are killed (None for its code). A hung
    rank gets SIGABRT first: PYTHONFAULTHANDLER makes it print every thread's Python stack."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    except subprocess.TimeoutExpired:
        return [None] * len(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                ranks = children(p.pid)
                for pid in ranks:
                    os.kill(pid, signal.SIGABRT)
                time.sleep(1)
                for pid in [p.pid, *ranks]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                p.wait()


def single_run(steps: int) -> tuple[list[float], dict]:
    """`single`'s losses and final weights, in this process (the CLI's defaults, float64)."""
    from refimpl.lab.cli import build_parser, config_from_args
    from refimpl.train import train_on_ranks

    args = build_parser().parse_args(["train", "--steps", str(steps), *MODEL])
    result = train_on_ranks(config_from_args(args).with_(return_state=True))
    return result["losses"], result["state_dict"]


def rel_err(got: list[float], want: list[float]) -> float:
    if len(got) != len(want):
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def result_of(out: Path) -> dict | None:
    for line in out.with_suffix(".out").read_text(errors="replace").splitlines():
        if line.startswith("{"):
            return json.loads(line)
    return None


def tail(path: Path, lines: int = 6) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def exits(runs: int, profile: bool, work: Path, steps: int = 3) -> list[str]:
    """The c10d rendezvous, 2 agents x 2 ranks, `runs` times; returns the failures (empty: clean)."""
    want, _ = single_run(steps)
    failures = []
    for i in range(runs):
        port = free_port()
        rdzv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"launch-check-{port}",
                "--max-restarts", "0"]
        cli = ["-m", "refimpl", "train", "--strategy", "zero1", "--tp", "2", "--steps", str(steps),
               *MODEL, "--json", *(["--profile", "--trace-dir", str(work / f"trace{i}")]
                                   if profile else [])]
        outs = [work / f"{'p' if profile else 'e'}{i}-agent{a}" for a in range(2)]
        t0 = time.monotonic()
        codes = finish([start(rdzv + cli, out) for out in outs], timeout=300)
        got = result_of(outs[0])
        err = rel_err(got["losses"], want) if got else float("inf")
        ok = codes == [0, 0] and err < GATE
        print(f"  run {i + 1:2d}/{runs}{' --profile' if profile else ''}: exit codes {codes}, "
              f"losses vs single {err:.1e}, {time.monotonic() - t0:.1f} s", flush=True)
        if not ok:
            failures.append(f"run {i + 1}: exit codes {codes}, loss error {err:.1e}\n"
                            + "\n".join(tail(o.with_suffix(".err")) for o in outs))
    return failures


def rank_pid(agent: int, rank: int) -> int | None:
    """The pid of the agent's worker whose environment says RANK=<rank>."""
    for pid in children(agent):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def restart(work: Path, steps: int = 20, every: int = 2) -> list[str]:
    """kill -9 of rank 1 after the first checkpoint; torchrun restarts; the job resumes."""
    want, weights = single_run(steps)
    ckpt, saved = work / "checkpoints", work / "final.pt"
    out = work / "restart"
    cli = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "-m", "refimpl", "train", "--strategy", "zero1", "--steps", str(steps), *MODEL,
           "--checkpoint-every", str(every), "--checkpoint-dir", str(ckpt),
           "--save-state", str(saved), "--json"]
    agent = start(cli, out)
    killed, deadline = None, time.monotonic() + 150
    while killed is None and agent.poll() is None and time.monotonic() < deadline:
        if any(ckpt.glob("step-[0-9]*[0-9]")):
            pid = rank_pid(agent.pid, 1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = (pid, sorted(p.name for p in ckpt.glob("step-[0-9]*[0-9]"))[-1])
        time.sleep(0.01)
    (code,) = finish([agent], timeout=max(deadline - time.monotonic(), 1))
    got = result_of(out)
    failures = []
    if killed is None:
        failures.append("the job ended before rank 1 could be killed after a checkpoint")
    if code != 0 or got is None:
        failures.append(f"torchrun exit code {code} after the kill\n{tail(out.with_suffix('.err'))}")
        return failures
    import torch

    from refimpl.lab.verify.equivalence import compare_states

    err = rel_err(got["losses"], want)
    w_err = compare_states(torch.load(saved, weights_only=False), weights)[0]
    print(f"  killed rank 1 (pid {killed[0]}) with {killed[1]} on disk; torchrun restarted; "
          f"resumed from step {got['resumed_from']}; losses vs single {err:.1e}, weights "
          f"{w_err:.1e}; exit code {code}", flush=True)
    if not got["resumed_from"] > 0:
        failures.append("the restarted job did not resume from a checkpoint")
    if not (err < GATE and w_err < GATE):
        failures.append(f"resumed run differs from single: losses {err:.1e}, weights {w_err:.1e}")
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", nargs="?", default="all",
                   choices=["all", "exits", "exits-plain", "exits-profile", "restart"])
    p.add_argument("--runs", type=int, default=20, help="runs per exits variant (default 20)")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep every run's output in DIR")
    args = p.parse_args(argv)
    failures = []
    with tempfile.TemporaryDirectory(prefix="launch-check-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        variants = {"all": (False, True), "exits": (False, True), "exits-plain": (False,),
                    "exits-profile": (True,)}.get(args.part, ())
        if variants:
            for profile in variants:
                print(f"exits: c10d rendezvous, 2 agents x 2 ranks{', --profile' if profile else ''}",
                      flush=True)
                failures += exits(args.runs, profile, work)
        if args.part in ("all", "restart"):
            print("restart: torchrun --max-restarts 1, kill -9 of rank 1", flush=True)
            failures += restart(work)
    for f in failures:
        print("FAILED:", f)
    print("launch-check:", "FAILED" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
