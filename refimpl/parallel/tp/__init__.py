"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022): each rank holds 1/t of every weight matrix.

    mappings.py      the conjugate f/g pairs (identity/all-reduce, and SP's all-gather/reduce-scatter)
    layers.py        ColumnParallelLinear, RowParallelLinear, the parallel MLP and attention
    overlap.py       --set tp_overlap=true: SP's all-gather / reduce-scatter decomposed under the matmuls
    vocab.py         the vocabulary-parallel embedding and cross-entropy
    parallelize.py   the transform: the reference GPT turned into this rank's TP model
    strategy.py      --strategy tp
    torch_plan.py    PyTorch's DTensor parallelize_module plan for the same GPT
    torch_tp.py      torch-tp, the twin
    checks.py        layer-by-layer checks against the reference (notebook 06)

`refimpl.parallel.tp.ColumnParallelLinear` / `RowParallelLinear` are a DESIGN contract.
"""
from refimpl.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
