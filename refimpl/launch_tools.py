"""What the launcher (refimpl.launch) may be handed from outside it: a faster way to start a rank,
a watch on the ranks, what a rank needs as it joins its group. The lab's runtime supplies them
(entry-point group "refimpl.launch"); these defaults add nothing: ranks start as fresh interpreters."""
from __future__ import annotations

import contextlib
from functools import cache
from pathlib import Path

import torch

from refimpl.seam import plugins


class LaunchTools:
    def backend(self, world_size: int) -> str | None:
        """A backend of the tools' own for every launch (the lab's staged one), or None."""
        return None

    def device(self, backend: str) -> torch.device:
        """Where a rank computes under `backend` (not NCCL: refimpl.process_group.device_for)."""
        return torch.device("cpu")

    def starter(self, backend: str):
        """Something with `start(env, stdout, stderr) -> process`, or None: `python -m refimpl._rank`."""
        return None

    def watch(self, folder: Path, backend: str):
        """None, or what `wait(ranks, tmp, timeout)`s as refimpl.launch.wait_all does, and more."""
        return None

    def rank_env(self, env: dict, backend: str, watch) -> None:
        """Additions to every rank's environment (`watch`: this launch's, or None)."""

    def torchrun_picked(self, local_ranks: int, asked: str, chosen: str) -> None:
        """Under torchrun, once `chosen` is picked for this node's `local_ranks` (`asked`: the caller's)."""

    def joining(self, backend: str, launched: bool, options: dict) -> None:
        """In a rank, before it joins its process group (`launched`: started by refimpl.launch);
        `options`: init_process_group's keywords, to complete."""

    def running(self):
        """In a rank, around the function it runs."""
        return contextlib.nullcontext()

    def device_settings(self, device, cfg) -> None:
        """Process-wide settings for the device a run of `cfg` computes on (refimpl.train)."""


@cache
def tools() -> LaunchTools:
    found = plugins("refimpl.launch")
    return found[0]() if found else LaunchTools()
