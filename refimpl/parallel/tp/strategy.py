"""`tp`: the whole world on the tensor-parallel axis (seed §3.3; Megatron-LM).

`--strategy tp --nproc T` is tp = T, dp = 1 (`whole_world_axis`): every rank holds 1/T of every
weight matrix (refimpl.parallel.tp.parallelize.parallelize_tp, applied by
refimpl.compose.transforms.model_parallel) and sees *all* rows of the global batch -- tensor
parallelism splits the model, not the data. Forward and backward communicate inside every block
(2 all-reduces per block per pass, or all-gather + reduce-scatter with --sequence-parallel); the
optimizer then updates each rank's slices with no further communication, because each slice's
gradient is complete on its owner (replicated parameters -- LayerNorms, row biases, positions --
hold equal gradients on every rank, or are summed over tp in backward under SP).

It is `dp-naive` with dp = 1: the same tensor-parallel model runs under any data-parallel flavour
with `--tp T` (e.g. `--strategy zero1 --tp 2 --nproc 4`). The loss is the vocabulary-parallel
cross-entropy the transform attaches to the model (refimpl.parallel.tp.vocab): equal on every
tp rank, since it is built from all-reduced per-token numbers.
"""
from __future__ import annotations

from refimpl.parallel.dp.naive import NaiveDataParallel


class TensorParallel(NaiveDataParallel):
    name = "tp"
    whole_world_axis = "tp"
