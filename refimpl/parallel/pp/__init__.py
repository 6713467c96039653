"""Pipeline parallelism: each rank holds consecutive blocks; micro-batches flow through a schedule."""
from refimpl.parallel.pp.schedules import bubble_fraction, schedule_table

__all__ = ["schedule_table", "bubble_fraction"]
