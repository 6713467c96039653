"""Column- and row-parallel linears (seed §3.3; Megatron-LM, Shoeybi et al. 2019, §3)."""
from __future__ import annotations

import torch
import torch.distributed as torch_dist
import torch.nn as nn

from refimpl.model.layers import WatchedLinear, linear_weight_grads
from refimpl.parallel.tp.mappings import (
    enter_region,
    exit_region,
    gather_last_dim,
    group_rank,
    group_size,
    split_last_dim,
)
from refimpl.placement import Shard, set_placement


def default_group(group):
    """`group=None` is the world group once one exists (as in torch.distributed), else one rank."""
    if group is None and torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.group.WORLD
    return group


def shard_rows(full: torch.Tensor, group, pad: bool = False) -> torch.Tensor:
    """This rank's slice of dim 0, zero-padded to a multiple of t when `pad`."""
    t, n = group_size(group), full.shape[0]
    if n % t:
        if not pad:
            raise ValueError(f"dim of size {n} does not divide by tensor-parallel size {t}")
        full = torch.cat([full, full.new_zeros((-(-n // t) * t - n,) + full.shape[1:])])
    return full.chunk(t, dim=0)[group_rank(group)].clone()


class ParallelLinear(WatchedLinear):
    """What both linears share: this rank's weight and bias, the tp group, and whether SP is on."""

    def __init__(self, weight, bias, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None


class ColumnParallelLinear(ParallelLinear):
    """Y_r = X·A_rᵀ + b_r: X enters the region (f, or SP's all-gather) unless the caller did it
    once for several layers (`input_in_region`). `gather_output`: the full Y; `pad`: rows to t·k."""

    def __init__(self, weight, bias, group, *, out_full: int, gather_output: bool = False,
                 sequence_parallel: bool = False, input_in_region: bool = False):
        super().__init__(weight, bias, group, sequence_parallel)
        self.out_full, self.gather_output, self.input_in_region = out_full, gather_output, input_in_region
        self.out_start = group_rank(group) * weight.shape[0]    # first output index held here
        for p in (self.weight, self.bias):
            if p is not None:
                set_placement(p, Shard("tp", 0, out_full))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, gather_output: bool = False, *,
                    sequence_parallel: bool = False, input_in_region: bool = False,
                    pad: bool = False) -> "ColumnParallelLinear":
        group = default_group(group)
        b = None if linear.bias is None else shard_rows(linear.bias.detach(), group, pad)
        return cls(shard_rows(linear.weight.detach(), group, pad), b, group,
                   out_full=linear.out_features, gather_output=gather_output,
                   sequence_parallel=sequence_parallel, input_in_region=input_in_region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x = enter_region(x, self.group, self.sequence_parallel)
        y = self._matmul(x, self.bias)
        if self.gather_output:
            y = gather_last_dim(y, self.group)[..., :self.out_full]
        return y


class RowParallelLinear(ParallelLinear):
    """Y = Σ_r X_r·A_rᵀ + b: partial sums reduced (g, or SP's reduce-scatter), then the
    replicated bias once. X is this rank's slice (input_is_parallel), or full and sliced here."""

    def __init__(self, weight, bias, group, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False):
        super().__init__(weight, bias, group, sequence_parallel)
        self.input_is_parallel = input_is_parallel
        set_placement(self.weight, Shard("tp", 1, weight.shape[1] * group_size(group)))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True, *,
                    sequence_parallel: bool = False) -> "RowParallelLinear":
        group = default_group(group)
        w = shard_rows(linear.weight.detach().t(), group).t().contiguous()
        b = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(w, b, group, input_is_parallel=input_is_parallel,
                   sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_last_dim(x, self.group)
        y = exit_region(self._matmul(x), self.group, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    def weight_grads(self, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
        """Under SP the bias meets only this rank's s/t tokens; the matmul's dY holds all: sum ours."""
        if self.bias is None or not self.sequence_parallel:
            return super().weight_grads(x, dy)
        ours = dy.chunk(group_size(self.group), dim=1)[group_rank(self.group)]
        return linear_weight_grads(x, dy, bias=False) + [ours.reshape(-1, dy.shape[-1]).sum(0)]
