"""Data parallelism: every rank holds the whole model and a slice of the batch; gradients agree."""
from refimpl.parallel.dp.data_parallel import DataParallel

__all__ = ["DataParallel"]
