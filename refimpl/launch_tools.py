"""What the launcher (refimpl.launch) may be handed from outside it: a faster way to start a rank,
a watch on the ranks' communication for the hang report, what a rank needs before its group
exists. The lab's runtime (refimpl/lab/runtime/) supplies them through the entry-point group
"refimpl.launch"; these defaults add nothing, and ranks start as fresh interpreters.
"""
from __future__ import annotations

import contextlib
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path


class LaunchTools:

    def starter(self, backend: str):
        """Something with `start(env, stdout, stderr) -> process`, or None: `python -m refimpl._rank`."""
        return None

    def rank_env(self, env: dict, backend: str, watch) -> None:
        """Additions to every rank's environment (`watch`: this launch's, or None)."""

    def watch(self, folder: Path, wanted: bool | None):
        """A watch on the ranks' communication calls (`waiting(ranks, posted)`: the calls every
        rank waits in, or None; `report(ranks, posted)`), kept under `folder`; None: no watch."""
        return None

    def joining(self, backend: str, launched: bool) -> None:
        """In a rank, before it joins its process group (`launched`: started by refimpl.launch)."""

    def running(self):
        """In a rank, around the function it runs."""
        return contextlib.nullcontext()


@cache
def tools() -> LaunchTools:
    found = [plugin.load() for plugin in entry_points(group="refimpl.launch")]
    return found[0]() if found else LaunchTools()
