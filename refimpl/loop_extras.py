"""What may be added to the one loop (refimpl.train) from outside it: the lab's step times, memory
counts, checkpoints, traces, initial states and shard-only build. `LoopExtras` adds nothing; a
plug-in under the entry-point group "refimpl.loop" replaces it (refimpl/lab/loop.py)."""
from __future__ import annotations

import contextlib

from refimpl.seam import plugins


class LoopExtras:
    """The loop's hooks, for one rank's run of `cfg`."""

    first: int = 0                 # the step the run starts at (a resumed run: its checkpoint's)
    losses: tuple = ()             # the losses of the steps before it
    # `place(strategy)`: builds and places the rank's model, returns the reference's parameter
    # count (refimpl.train.setup_rank); None: refimpl.train.place_seeded
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
        """A context around one step (the lab's times it and counts the bytes autograd saves)."""
        return contextlib.nullcontext()

    def finish(self, strategy, result: dict) -> None:
        """The rank's result, once the steps are done: fields to add."""

    @staticmethod
    def merged(cfg, per_rank: list[dict]) -> dict:
        """In the launching process: fields of the run's result, merged from every rank's."""
        return {}


def extras_class() -> type[LoopExtras]:
    """The plug-in's class where one is installed (the lab's), else the plain loop's."""
    found = plugins("refimpl.loop")
    return found[0] if found else LoopExtras
