"""The `--strategy` names: which strategy class runs each, and what a shorthand fills in.

    layout = resolve(TrainConfig(strategy="pp-1f1b", nproc=4, tp=2))
    layout.cfg.pp, layout.cfg.schedule, layout.strategy    # 2, "1f1b", NaiveDataParallel"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache

from refimpl.config import TrainConfig
from refimpl.mesh import LayoutError
from refimpl.seam import plugins
from refimpl.strategy import Strategy


@dataclass(frozen=True)
class Entry:
    strategy: str                    # "module:Class" of the strategy that runs it
    axis: str | None = None          # a shorthand's axis: it takes the ranks the others leave
    schedule: str | None = None      # a pipeline shorthand's schedule


NAIVE = "refimpl.parallel.dp.naive:NaiveDataParallel"
# pp-<name>: the schedule it runs (refimpl.parallel.pp.schedules)
PIPELINE_SHORTHANDS = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zb": "zb-h1"}


OWN = {   # refimpl's own names; the plug-ins' are added by `strategies()`
    "single": Entry("refimpl.parallel.dp.single:Single"),
    # the data-parallel flavours
    "dp-naive": Entry(NAIVE),
    "dp": Entry("refimpl.parallel.dp.bucketed:BucketedDataParallel"),
    "zero1": Entry("refimpl.parallel.zero.stages:Zero1"),
    "zero2": Entry("refimpl.parallel.zero.stages:Zero2"),
    "zero3": Entry("refimpl.parallel.fsdp.zero3:Zero3"),
    "fsdp": Entry("refimpl.parallel.fsdp.zero3:FSDP"),
    # the shorthands: a flavour and the axis they name
    "tp": Entry(NAIVE, axis="tp"),
    **{f"pp-{name}": Entry(NAIVE, axis="pp", schedule=s) for name, s in PIPELINE_SHORTHANDS.items()},
    "ep": Entry(NAIVE, axis="ep"),
}


@cache
def strategies() -> dict[str, Entry]:
    """The `--strategy` names: refimpl's own, then each plug-in's (loaded on first use)."""
    every = dict(OWN)
    for plugin in plugins("refimpl.strategies"):
        added = plugin()
        if set(added) & set(every):
            raise ValueError(f"{plugin} names strategies already named: {sorted(set(added) & set(every))}")
        every.update(added)
    return every


@dataclass(frozen=True)
class Resolved:
    """A configuration with its shorthand filled in, and the class that runs it (as the variants'
    plug-ins make it)."""
    cfg: TrainConfig
    strategy: type[Strategy]


def entry_of(name: str) -> Entry:
    if name not in strategies():
        raise LayoutError(f"unknown strategy {name!r}; choose one of: {', '.join(strategies())}")
    return strategies()[name]


def strategy_class(name: str) -> type[Strategy]:
    module, cls = entry_of(name).strategy.split(":")
    return getattr(importlib.import_module(module), cls)


def resolve(cfg: TrainConfig) -> Resolved:
    """`cfg` with its strategy's shorthand applied (idempotent), and the strategy's class."""
    entry = entry_of(cfg.strategy)
    changes = {}
    if entry.axis is not None:
        changes[entry.axis] = _whole_world(cfg, entry.axis)
    if entry.schedule is not None and cfg.schedule is None:   # another schedule: refused before launch
        changes["schedule"] = entry.schedule
    cfg = cfg.with_(**changes) if changes else cfg
    return Resolved(cfg, variant(cfg, strategy_class(cfg.strategy)))


def variant(cfg: TrainConfig, cls: type[Strategy]) -> type[Strategy]:
    """`cls` as the "refimpl.variants" plug-ins make it for `cfg` (each may raise LayoutError)."""
    for plugin in plugins("refimpl.variants"):
        cls = plugin(cfg, cls)
    return cls


def _whole_world(cfg: TrainConfig, axis: str) -> int:
    """The size of a shorthand's axis: as given, or the ranks the other axes leave (ep: every
    data-parallel rank, dp x cp, since expert parallelism reuses them)."""
    if getattr(cfg, axis) != 1:
        return getattr(cfg, axis)
    dims = cfg.dims     # its dp: the ranks the other axes leave
    return dims.dp * dims.cp if axis == "ep" else dims.dp
