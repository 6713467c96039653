"""How the lab waits for a launch's ranks (refimpl.launch_tools' `watch`): each rank's flight
recorder, read by the stall watchdog and the hang report, and a failed rank named by cause
(refimpl.lab.runtime.rank_failures) with the others that failed in its wake."""
from __future__ import annotations

import time
from pathlib import Path

from refimpl.lab.runtime import flight_recorder
from refimpl.lab.runtime.rank_failures import rank_failed
from refimpl.launch import LaunchTimeoutError


class Watch:
    """One launch's watch. `folder`: where each rank's flight recorder is kept (None: no recorder,
    so no stall watchdog and no hang report). `stall`: seconds every running rank may wait in the
    same communication call before the launch is called hung (None: only the timeout ends it)."""

    def __init__(self, folder: Path | None, backend: str = "gloo", stall: float | None = None):
        self.folder, self.stall = folder, stall
        self.posted = backend == "nccl"      # an NCCL call returns once posted, and waits after it
        if folder is not None:
            folder.mkdir(exist_ok=True)
        self._calls, self._since, self._next_look = None, 0.0, 0.0

    def wait(self, ranks: list, tmp: Path, timeout: float) -> None:
        """Until every rank has exited 0: refimpl.launch's wait, with the hang report and the
        rank that failed first by cause."""
        deadline = time.monotonic() + timeout
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
                    hung = self.report([x.rank for x in ranks]) if self.posted and self.folder else ""
                    raise rank_failed(ranks, tmp, r, exited, hung)
            hang = self.stalled(sorted(pending)) if self.stall is not None else None
            if hang is None and time.monotonic() > deadline:
                hang = f"ranks {sorted(pending)} still running after {timeout:.0f} s"
            if hang is not None:
                where = "\n" + self.report(sorted(pending)) if self.folder is not None else ""
                raise LaunchTimeoutError(f"{hang}; killed all {len(ranks)} ranks{where}")
            time.sleep(0.02)

    def stalled(self, ranks: list[int]) -> str | None:
        """Say so once every running rank has waited `stall` seconds in the same call (on NCCL,
        where a call returns once posted: since the same last posted call); None until then."""
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + 0.25          # a look reads each running rank's 16 KiB ring
        calls = flight_recorder.waiting_in(self.folder, ranks, self.posted)
        if calls != self._calls:              # someone moved on (or not everyone waits yet)
            self._calls, self._since = calls, now
        elif calls is not None and now - self._since >= self.stall:
            waited = "after the same posted" if self.posted else "in the same communication"
            return f"ranks {ranks} each waited {self.stall:g} s {waited} call"
        return None

    def report(self, ranks: list[int]) -> str:
        return (flight_recorder.where_nccl_waits(self.folder, ranks) if self.posted
                else flight_recorder.hang_report(self.folder, ranks))
