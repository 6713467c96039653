"""The feed-forward layer split over tp (seed §3.3, FFN 블록): Y = GELU(X·A)·B with A column- and
B row-parallel, so rank r computes GELU(X·A_r)·B_r alone; one reduction forward, one backward.
Llama's SwiGLU splits W_gate and W_up alike, so the product ⊙ stays local.

    block.mlp = parallel_feed_forward(block.mlp, group, sequence_parallel=sp)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from refimpl.model.swiglu import SwiGLU
from refimpl.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, default_group
from refimpl.parallel.tp.mappings import enter_region


class ColumnInputs(nn.Module):
    """A module whose column layers (built `input_in_region`) read one X that enters the region
    once (Q, K, V; SwiGLU's gate and up): one all-reduce of X's gradient, not one per layer."""

    def columns(self, x: torch.Tensor, layers) -> tuple:
        x = enter_region(x, self.group, self.sequence_parallel)
        return tuple(layer(x) for layer in layers)


class ParallelMLP(nn.Module):
    """GELU(X·A_r)·B_r on rank r, reduced over ranks by the row layer."""

    def __init__(self, up: ColumnParallelLinear, down: RowParallelLinear):
        super().__init__()
        self.up, self.down = up, down

    @classmethod
    def from_mlp(cls, mlp: nn.Module, group=None, sequence_parallel: bool = False) -> "ParallelMLP":
        up = ColumnParallelLinear.from_linear(mlp.up, group, sequence_parallel=sequence_parallel)
        down = RowParallelLinear.from_linear(mlp.down, group, sequence_parallel=sequence_parallel)
        return cls(up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ParallelSwiGLU(ColumnInputs):
    """(SiLU(X·W_gate,r) ⊙ X·W_up,r)·W_down,r: X enters the region once for gate and up."""

    def __init__(self, gate: ColumnParallelLinear, up: ColumnParallelLinear,
                 down: RowParallelLinear, group, sequence_parallel: bool):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.group, self.sequence_parallel = group, sequence_parallel

    @classmethod
    def from_swiglu(cls, mlp: SwiGLU, group=None,
                    sequence_parallel: bool = False) -> "ParallelSwiGLU":
        gate, up = (ColumnParallelLinear.from_linear(lin, group, input_in_region=True)
                    for lin in (mlp.gate, mlp.up))
        down = RowParallelLinear.from_linear(mlp.down, group, sequence_parallel=sequence_parallel)
        return cls(gate, up, down, default_group(group), sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.columns(x, (self.gate, self.up))
        return self.down(F.silu(gate) * up)


def parallel_feed_forward(mlp: nn.Module, group=None, sequence_parallel: bool = False) -> nn.Module:
    """The tensor-parallel form of a dense feed-forward layer (GELU MLP or SwiGLU)."""
    if isinstance(mlp, SwiGLU):
        return ParallelSwiGLU.from_swiglu(mlp, group, sequence_parallel)
    return ParallelMLP.from_mlp(mlp, group, sequence_parallel)
