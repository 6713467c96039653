"""The lab's runtime on refimpl.launch (through refimpl.launch_tools, entry-point group
"refimpl.launch"): CPU ranks forked from a warm zygote, each rank's flight recorder and the hang
report read from it, PyTorch's own flight recorder on NCCL ranks, the staged NCCL-rules backend
registered in a rank, and the device audit (REFIMPL_DEVICE_AUDIT) around what a rank runs."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from refimpl.lab.runtime import flight_recorder, zygote_client
from refimpl.launch_tools import LaunchTools


class Watch:
    """Each rank's flight recorder, kept in `folder`: what the stall watchdog and the report read."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(exist_ok=True)
        self._calls, self._since, self._next_look = None, 0.0, 0.0

    def stalled(self, ranks: list[int], posted: bool, stall: float) -> str | None:
        """Say so once every running rank has waited `stall` seconds in the same call (on NCCL,
        where a call returns once posted: since the same last posted call); None until then."""
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + 0.25          # a look reads each running rank's 16 KiB ring
        calls = self.waiting(ranks, posted)
        if calls != self._calls:              # someone moved on (or not everyone waits yet)
            self._calls, self._since = calls, now
        elif calls is not None and now - self._since >= stall:
            waited = "after the same posted" if posted else "in the same communication"
            return f"ranks {ranks} each waited {stall:g} s {waited} call"
        return None

    def waiting(self, ranks: list[int], posted: bool):
        return flight_recorder.waiting_in(self.folder, ranks, posted)

    def report(self, ranks: list[int], posted: bool) -> str:
        return (flight_recorder.where_nccl_waits(self.folder, ranks) if posted
                else flight_recorder.hang_report(self.folder, ranks))


class RuntimeTools(LaunchTools):

    def starter(self, backend: str):
        return zygote_client.for_backend(backend)

    def rank_env(self, env: dict, backend: str, watch) -> None:
        env[flight_recorder.ENV] = str(watch.folder) if watch is not None else "0"
        if backend == "nccl":
            for key, value in flight_recorder.nccl_env(flight_recorder.nccl_dumps()).items():
                env.setdefault(key, value)      # the caller's own settings win

    def watch(self, folder: Path, wanted: bool | None):
        if wanted is None:
            wanted = os.environ.get(flight_recorder.ENV) != "0"
        return Watch(folder) if wanted else None

    def joining(self, backend: str, launched: bool) -> None:
        if backend == "nccl" and not launched:      # torchrun: no launcher set these
            job = flight_recorder.nccl_dumps(f"torchrun-{os.environ.get('MASTER_PORT', '0')}")
            for key, value in flight_recorder.nccl_env(job).items():
                os.environ.setdefault(key, value)
        # the staged backend registered in every rank: its own default group, or a gloo rank's
        # new_group(backend="staged") (tests/test_nccl_rules.py)
        from refimpl.lab.runtime import shared_device  # noqa: F401

    @contextlib.contextmanager
    def running(self):
        folder = os.environ.get("REFIMPL_DEVICE_AUDIT")   # a test mode (device_audit.py)
        if not folder:
            yield
            return
        from refimpl.lab.runtime.device_audit import FactoryAudit

        with FactoryAudit() as factories:
            yield
        factories.write(folder, int(os.environ["RANK"]))
