"""The launcher's side of the zygote (refimpl/lab/runtime/zygote.py, which says why it exists): start it once
per launching process, ask it for a rank, and read each rank's exit status.

`refimpl.launch` calls `for_backend(backend)` and gets a Zygote, or None where ranks start as fresh
interpreters. A forked rank is handed back as a `_ForkedRank`, which answers `poll`, `wait` and
`pid` as the subprocess.Popen of a fresh rank would, so the launcher treats both alike.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class _ForkedRank:
    """A rank forked by the zygote, with the part of subprocess.Popen's interface we use."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        code = self.zygote.exit_codes.get(self.pid)
        if code is None and not self.zygote.alive() and not _pid_alive(self.pid):
            return -signal.SIGKILL        # the zygote died; the kernel killed its children
        return code

    def kill_group(self) -> None:
        """SIGKILL the rank's session, through the zygote (which alone knows the pid is still the
        rank's: refimpl.lab.runtime.zygote's protocol says why the launcher must not kill by pid)."""
        self.zygote.kill(self.pid)

    def wait(self) -> int:
        while (code := self.poll()) is None:
            time.sleep(0.005)
        return code


class Zygote:
    """The launcher's side of refimpl.lab.runtime.zygote: start it once, ask it for ranks, read their exits."""

    def __init__(self, env: dict):
        self.env, self.sources = env, source_stamp()
        self.proc = subprocess.Popen([sys.executable, "-m", "refimpl.lab.runtime.zygote"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        if self.proc.stdout.readline() != b"ready\n":
            self.proc.kill()
            raise RuntimeError("the rank zygote did not start")
        self.exit_codes: dict[int, int] = {}
        self.pids: queue.Queue[int] = queue.Queue()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="refimpl-zygote").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, *values = line.split()
            if kind == b"pid":   # a pid the kernel reused: forget the exit of its namesake
                self.exit_codes.pop(int(values[0]), None)
                self.pids.put(int(values[0]))
            elif kind == b"exit":
                self.exit_codes[int(values[0])] = int(values[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, env: dict, stdout: Path, stderr: Path) -> _ForkedRank:
        request = {"env": env, "cwd": os.getcwd(), "stdout": str(stdout), "stderr": str(stderr)}
        with self.lock:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            return _ForkedRank(self, self.pids.get(timeout=60))

    def kill(self, pid: int) -> None:
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps({"kill": pid}).encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:           # the zygote is gone, and its children with it
                pass

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait()


_CURRENT: Zygote | None = None


def for_backend(backend: str) -> Zygote | None:
    """The zygote for CPU ranks (gloo, and the staged backend with every rank on the CPU), started
    on first use and again whenever the launcher's environment or refimpl's sources changed (a
    forked rank must see the environment and the code a fresh one would: the zygote has refimpl
    imported). None where ranks start as fresh interpreters instead: GPU ranks, NCCL's or the
    staged backend's on a shared cuda device (CUDA after fork was never run here, so they keep the
    path known to work), non-Linux systems, and REFIMPL_LAUNCH=spawn."""
    global _CURRENT
    on_cpu = backend == "gloo" or (
        backend == "staged" and os.environ.get("REFIMPL_SHARED_DEVICE", "cpu").startswith("cpu"))
    if not on_cpu or not sys.platform.startswith("linux") or \
            os.environ.get("REFIMPL_LAUNCH", "fork") == "spawn":
        return None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if _CURRENT is not None and (_CURRENT.env != env or _CURRENT.sources != source_stamp()
                                 or not _CURRENT.alive()):
        _CURRENT.close()
        _CURRENT = None
    if _CURRENT is None:
        try:
            _CURRENT = Zygote(env)
        except (OSError, RuntimeError):
            return None                  # fall back to fresh interpreters
    return _CURRENT


def source_stamp() -> tuple:
    """(path, mtime, size) of every refimpl source file: what the zygote imported."""
    package = Path(__file__).resolve().parents[2]      # refimpl/
    return tuple((str(p), s.st_mtime_ns, s.st_size)
                 for p in sorted(package.rglob("*.py")) for s in (p.stat(),))


@atexit.register
def _close_zygote() -> None:
    if _CURRENT is not None:
        _CURRENT.close()


def current_pid() -> int | None:
    """The zygote's pid while one runs (it is a child of this process between launches)."""
    return _CURRENT.proc.pid if _CURRENT is not None and _CURRENT.alive() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
