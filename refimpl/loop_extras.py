"""What may be added to the one loop (refimpl.train) from outside it: the lab's checkpoints, traces,
initial states, shard-only build and records reach the loop through this one record, never through
the loop's code.

`LoopExtras` is the plain loop's: it adds nothing. A plug-in registered under the entry-point group
"refimpl.loop" replaces it (refimpl/lab/loop.py); the loop calls the same hooks either way.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

from refimpl.seam import plugins


class LoopExtras:
    """The loop's hooks, for one rank's run of `cfg`."""

    first: int = 0                 # the step the run starts at (a resumed run: its checkpoint's)
    losses: tuple = ()             # the losses of the steps before it
    # `place(strategy)`: builds the rank's model and places it, returning the reference's parameter
    # count (refimpl.train.setup_rank); None: the loop's own, refimpl.train.place_seeded
    place = None

    def __init__(self, cfg, rank: int, world_size: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size

    @staticmethod
    def validate(cfg, strategy_class) -> None:
        """In the launching process: raise LayoutError (one line) for a run the extras refuse."""

    def steps(self, ctx, strategy, first: int):
        """A context around the steps; it yields `on_step(step, losses)`, called after each with
        the losses so far."""
        return contextlib.nullcontext(lambda step, losses: None)

    def measure_step(self, strategy):
        """A context around one step, yielding what has `peak`: the bytes autograd saved for
        backward (none measured here; the lab's count them)."""
        return contextlib.nullcontext(SimpleNamespace(peak=0))

    def finish(self, strategy, result: dict) -> None:
        """The rank's result, once the steps are done: fields to add."""


def extras_class() -> type[LoopExtras]:
    """The plug-in's class where one is installed (the lab's), else the plain loop's."""
    found = plugins("refimpl.loop")
    return found[0] if found else LoopExtras
