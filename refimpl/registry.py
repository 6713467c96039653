"""The `--strategy` names: which strategy class runs each, and what a shorthand fills in.

    layout = resolve(TrainConfig(strategy="pp-1f1b", nproc=4, tp=2))
    layout.cfg.pp, layout.cfg.schedule, layout.strategy    # 2, "1f1b", NaiveDataParallel

A name is one of three kinds:

  * a data-parallel flavour (`dp-naive`, `dp`, `zero1`, `zero2`, `zero3`, `fsdp`): its class
    places the model on the dp axis; any other axis comes from the flags (`--tp --pp --cp --ep`);
  * a shorthand (`tp`, `pp-<schedule>`, `ep`): a flavour (dp-naive's plain all-reduce after the
    step) plus the axis it names, which takes the ranks the other axes leave when it was not
    given (`--strategy tp --nproc 4` is tp = 4; `--strategy pp-1f1b --nproc 4 --tp 2` is
    tp 2 x pp 2; `--strategy ep` puts every dp x cp rank in one ep group), and for pp-* its
    schedule. So `--strategy pp-zbv --nproc 2` and `--strategy dp-naive --pp 2 --schedule zbv
    --nproc 2` are the same layout, run by the same code;
  * PyTorch's twins (`torch-*`), the comparators: their own classes; `torch-tp` and `torch-pp-*`
    are shorthands too (the whole world on their axis).

`resolve` is the one place a name is looked up: the launcher resolves a configuration once to
validate it, and each rank once to run it (refimpl.train). The entries are "module:Class" strings,
imported on first use, so naming every strategy does not import every parallelism.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from refimpl.config import TrainConfig
from refimpl.mesh import LayoutError
from refimpl.strategy import Strategy


@dataclass(frozen=True)
class Entry:
    strategy: str                    # "module:Class" of the strategy that runs it
    axis: str | None = None          # a shorthand's axis: it takes the ranks the others leave
    schedule: str | None = None      # a pipeline shorthand's schedule


NAIVE = "refimpl.parallel.dp.naive:NaiveDataParallel"
TORCH_PP = "refimpl.parallel.pp.torch_pp:TorchPipelineParallel"
# pp-<name>: the schedule it runs (refimpl.parallel.pp.schedules)
PIPELINE_SHORTHANDS = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved",
                       "zb": "zb-h1", "interleaved-zb": "interleaved-zb", "zbv": "zbv",
                       "dualpipev": "dualpipev"}
TORCH_PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")

STRATEGIES: dict[str, Entry] = {
    "single": Entry("refimpl.parallel.dp.single:Single"),
    # the data-parallel flavours
    "dp-naive": Entry(NAIVE),
    "dp": Entry("refimpl.parallel.dp.bucketed:BucketedDataParallel"),
    "zero1": Entry("refimpl.parallel.zero.stages:Zero1"),
    "zero2": Entry("refimpl.parallel.zero.stages:Zero2"),
    "zero3": Entry("refimpl.parallel.fsdp.zero3:Zero3"),
    "fsdp": Entry("refimpl.parallel.fsdp.fully_shard:FSDP"),
    # the shorthands: a flavour and the axis they name
    "tp": Entry(NAIVE, axis="tp"),
    **{f"pp-{name}": Entry(NAIVE, axis="pp", schedule=s) for name, s in PIPELINE_SHORTHANDS.items()},
    "ep": Entry(NAIVE, axis="ep"),
    # PyTorch's twins
    "torch-ddp": Entry("refimpl.parallel.dp.torch_ddp:TorchDDP"),
    "torch-zero1": Entry("refimpl.parallel.zero.torch_zero1:TorchZero1"),
    "torch-fsdp2": Entry("refimpl.parallel.fsdp.torch_fsdp2:TorchFSDP2"),
    "torch-fsdp2-gradop": Entry("refimpl.parallel.fsdp.torch_fsdp2:TorchFSDP2GradOp"),
    "torch-tp": Entry("refimpl.parallel.tp.torch_tp:TorchTensorParallel", axis="tp"),
    "torch-fsdp2-tp": Entry("refimpl.compose.torch_fsdp2_tp:TorchFSDP2TP"),
    **{f"torch-pp-{s}": Entry(TORCH_PP, axis="pp", schedule=s) for s in TORCH_PIPELINE_SCHEDULES},
}
AXIS_NAMES = {"tp": "tensor", "pp": "pipeline", "ep": "expert"}


@dataclass(frozen=True)
class Resolved:
    """A configuration with its shorthand filled in, and the class that runs it."""
    cfg: TrainConfig
    strategy: type[Strategy]


def entry_of(name: str) -> Entry:
    if name not in STRATEGIES:
        raise LayoutError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def strategy_class(name: str) -> type[Strategy]:
    module, cls = entry_of(name).strategy.split(":")
    return getattr(importlib.import_module(module), cls)


def resolve(cfg: TrainConfig) -> Resolved:
    """`cfg` with its strategy's shorthand applied (idempotent), and the strategy's class."""
    entry = entry_of(cfg.strategy)
    changes = {}
    if entry.axis is not None:
        size = _whole_world(cfg, entry.axis)
        if size < 2:
            raise LayoutError(f"--strategy {cfg.strategy} puts on {entry.axis} the ranks the other "
                              f"axes leave, and they leave {size} of --nproc {cfg.nproc}: "
                              f"{AXIS_NAMES[entry.axis]} parallelism needs >= 2")
        changes[entry.axis] = size
    if entry.schedule is not None:
        if cfg.schedule not in (None, entry.schedule):
            raise LayoutError(f"--strategy {cfg.strategy} runs the {entry.schedule} schedule; "
                              f"drop --schedule {cfg.schedule}")
        changes["schedule"] = entry.schedule
    return Resolved(cfg.with_(**changes) if changes else cfg, strategy_class(cfg.strategy))


def _whole_world(cfg: TrainConfig, axis: str) -> int:
    """The size of a shorthand's axis: as given, or the ranks the other axes leave (ep: every
    data-parallel rank, dp x cp, since expert parallelism reuses them)."""
    if getattr(cfg, axis) != 1:
        return getattr(cfg, axis)
    grid = cfg.replicas * cfg.pp * cfg.cp * cfg.tp
    if axis == "ep":
        return max(cfg.nproc // grid, 1) * cfg.cp
    return max(cfg.nproc // grid, 1)
