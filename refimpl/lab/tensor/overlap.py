"""`--set tp_overlap=true`, a "refimpl.variants" plug-in (refimpl.registry): the run's strategy class
with a `transform` that turns the core's sequence-parallel tp layers into the subclasses below,
whose collectives run decomposed under their matmuls (ring.py). The core has no overlap branch."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from refimpl.lab.tensor.ring import gather_linears, linear_reduce_scatter
from refimpl.mesh import LayoutError
from refimpl.parallel.tp.blocks import ColumnInputs
from refimpl.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear
from refimpl.parallel.tp.mappings import gather_last_dim, group_size, split_last_dim
from refimpl.rank_model import RankModel
from refimpl.strategy import Strategy


class OverlappedColumnInputs:
    """Column layers fed one X: the sequence all-gather decomposed under all their matmuls."""

    def columns(self, x: torch.Tensor, layers) -> tuple:
        return gather_linears(x, layers, self.group)


class OverlappedColumnParallelLinear(ColumnParallelLinear):
    """A column layer that gathers its own input: the gather decomposed under its matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_in_region:
            return super().forward(x)
        (y,) = gather_linears(x, [self], self.group)
        return gather_last_dim(y, self.group)[..., :self.out_full] if self.gather_output else y


class OverlappedRowParallelLinear(RowParallelLinear):
    """A row layer whose reduce-scatter sends each chunk's partial sum while the next is computed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_last_dim(x, self.group)
        y = linear_reduce_scatter(x, self.weight, self.group)
        return y + self.bias if self.bias is not None else y


def problem(cfg) -> str | None:
    """One line naming why `--set tp_overlap=true` cannot run a TrainConfig, or None: the ring
    replaces SP's collectives, zero bubble's W needs the gathered input the ring never builds
    (ParallelLinear.watch_matmul), and the ring's Functions run in the input's dtype."""
    option = "--set tp_overlap=true"
    if not cfg.sequence_parallel:
        return f"{option} needs --sequence-parallel (it decomposes SP's all-gather and reduce-scatter)"
    if cfg.pp > 1:
        return f"{option} does not compose with --pp yet (zero-bubble's W needs the gathered input)"
    if cfg.cp > 1:
        return f"{option} does not compose with --cp (ring attention keeps its own all-gather)"
    if cfg.mixed_precision != "fp32":
        return f"{option} runs in the model's dtype; drop --mixed-precision {cfg.mixed_precision}"
    return None


@functools.cache
def _overlapped_class(cls: type) -> type:
    if issubclass(cls, ColumnInputs):
        return type("Overlapped" + cls.__name__, (OverlappedColumnInputs, cls), {})
    plain = {ColumnParallelLinear: OverlappedColumnParallelLinear,
             RowParallelLinear: OverlappedRowParallelLinear}
    return plain[cls]


def decompose(model: nn.Module) -> nn.Module:
    """Turn every sequence-parallel tp layer of `model` (in place, names and tensors kept) into its
    ring form; layers without SP (an MoE layer's experts) stay as they are."""
    for module in model.modules():
        plain = type(module) in (ColumnParallelLinear, RowParallelLinear)
        fed_once = isinstance(module, ColumnInputs) and not isinstance(module, OverlappedColumnInputs)
        if (plain or fed_once) and module.sequence_parallel and group_size(module.group) > 1:
            module.__class__ = _overlapped_class(type(module))
    return model


class TpOverlap:
    """Mixed over the run's strategy class: its transform, then `decompose`."""

    def transform(self, reference: nn.Module, transforms) -> RankModel:
        rank_model = super().transform(reference, transforms)
        decompose(rank_model.module)
        return rank_model


def variant(cfg, strategy_class: type[Strategy]) -> type[Strategy]:
    """The plug-in: `strategy_class` itself, or with `TpOverlap` mixed in where the option is set."""
    if "tp_overlap" not in strategy_class.options or not cfg.options.get("tp_overlap", False):
        return strategy_class
    why = problem(cfg)
    if why:
        raise LayoutError(why)
    return _mixed(strategy_class)


@functools.cache
def _mixed(strategy_class: type[Strategy]) -> type[Strategy]:
    return type("TpOverlap" + strategy_class.__name__, (TpOverlap, strategy_class), {})
