"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022): each rank holds 1/t of every weight matrix.

    mappings.py      the conjugate f/g pairs (identity/all-reduce; SP's all-gather/reduce-scatter)
    layers.py        ColumnParallelLinear, RowParallelLinear (a DESIGN contract)
    blocks.py        the parallel MLP and SwiGLU;  attention.py  attention and GQA by heads
    vocab.py         the vocabulary-parallel embedding and cross-entropy
    experts.py       MoE experts split over tp;   overlap.py  SP's collectives under the matmuls
    parallelize.py   the transform: the reference GPT turned into this rank's TP model
"""
from refimpl.parallel.tp.layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "ParallelLinear", "RowParallelLinear"]
