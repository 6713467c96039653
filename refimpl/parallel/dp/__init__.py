"""Data parallelism: every rank holds the whole model and a slice of the batch; gradients agree.

    single.py        the reference: one process, the whole batch
    naive.py         dp-naive: one all-reduce per parameter after backward
    flat_param.py    parameters viewed as one flat buffer, cut into equal shards (padded)
    grad_buckets.py  gradient buckets reduced as backward produces them (Li et al. 2020)
    data_parallel.py DataParallel: those buckets around any nn.Module (a learner's own model)
    wrapping.py      what every module-level wrapper checks first (one line per bad use)
    bucketed.py      dp: ours, bucketed and overlapped with backward (DDP's design): DataParallel
"""
from refimpl.parallel.dp.data_parallel import DataParallel

__all__ = ["DataParallel"]
