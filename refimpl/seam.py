"""The one seam between the mechanisms and the tools that watch them (DESIGN.md, "Layout").

    from refimpl.seam import dist, phase
    dist.all_reduce(p.grad, group=group)       # reads exactly like torch.distributed
    with phase("forward"): ...                  # a named range of a step"""
from __future__ import annotations

from contextlib import nullcontext
from functools import cache
from importlib.metadata import entry_points

import torch.autograd.profiler as profiler
import torch.distributed as torch_dist

# torch 2.13 renamed two collectives and warns on the old names; the torch of many GPU servers
# (2.11) has only the old ones. Mechanisms call the old names; they go to the current one.
RENAMED = {"all_gather_into_tensor": "all_gather_single",
           "reduce_scatter_tensor": "reduce_scatter_single"}


def current_name(name: str) -> str:
    """The name torch.distributed's `name` has in the installed torch."""
    new = RENAMED.get(name)
    return new if new is not None and hasattr(torch_dist, new) else name


_NOTHING = nullcontext()


def plain_phase(name: str):
    """A profiler range named `name` while a profiler records; nothing otherwise (an idle
    record_function still costs microseconds, and a pipeline step opens dozens)."""
    return profiler.record_function(name) if profiler._is_profiler_enabled else _NOTHING


def lookup(collectives, name: str):
    """`name` from `collectives`, else from torch.distributed, looked up at call time (so a wrapper
    put on torch.distributed's functions, the dry run's or a test's, still sees every call)."""
    found = getattr(collectives, name, None)
    return found if found is not None else getattr(torch_dist, current_name(name))


class Seam:
    """What `dist`, `phase`, `span` and `message` go to. The lab's plug-ins (entry-point group
    "refimpl.seam", each `attach(SEAM)`) replace `calls`, `phase`, `span` and `message` on first use."""

    def __init__(self):
        self.collectives = None   # torch.distributed's own, or refimpl.comm (use_collectives)
        self.calls = None         # what dist.<name> resolves on; None: `lookup(collectives, name)`
        self.phase = plain_phase
        self.span = lambda op, nbytes=None, group=None, peer=None, tag=None: _NOTHING
        self.message = lambda direction, nbytes: None
        self.loaded = False

    def __getattr__(self, name: str):
        """`dist.<name>`: the collective `name` as the seam has it now."""
        calls = attached().calls
        return getattr(calls, name) if calls is not None else lookup(self.collectives, name)


SEAM = Seam()


def attached() -> Seam:
    """The seam, with what the plug-ins attach to it (loaded on first use, in every process)."""
    if not SEAM.loaded:
        SEAM.loaded = True
        for attach in plugins("refimpl.seam"):
            attach(SEAM)
    return SEAM


dist = SEAM     # dist.<name>: torch.distributed's signatures, whatever is attached


def phase(name: str):
    return attached().phase(name)


def span(op: str, nbytes: int | None = None, group=None, peer: int | None = None,
         tag: int | None = None):
    return attached().span(op, nbytes, group, peer, tag)


def message(direction: str, nbytes: int) -> None:
    """One message of a rebuilt collective: direction "sent" or "received"."""
    attached().message(direction, nbytes)


def use_collectives(collectives) -> None:
    """Run this process's mechanisms on `collectives` (torch.distributed's names and signatures):
    refimpl.comm for `--collectives refimpl`, None for torch.distributed's own."""
    SEAM.collectives = collectives


@cache
def plugins(group: str) -> tuple:
    """What the lab registered under the entry-point group `group`, each loaded once (a package
    installed twice lists an entry point twice: kept once)."""
    return tuple(found.load() for found in {e.value: e for e in entry_points(group=group)}.values())
