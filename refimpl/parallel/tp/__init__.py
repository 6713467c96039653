"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022): each rank holds 1/t of every weight matrix."""
from refimpl.parallel.tp.layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "ParallelLinear", "RowParallelLinear"]
