"""Collective communication rebuilt from point-to-point send/recv, as drop-in twins of torch's
(send/recv themselves are torch.distributed's: the seam finds them there)."""
from torch.distributed import ReduceOp

from refimpl.comm.linear import gather, scatter
from refimpl.comm.pairwise import all_to_all, all_to_all_single
from refimpl.comm.ring import (
                               all_gather,
                               all_gather_into_tensor,
                               all_reduce,
                               reduce_scatter,
                               reduce_scatter_tensor,
)
from refimpl.comm.tree import broadcast, reduce
from refimpl.comm.work import Work

__all__ = [
    "ReduceOp", "Work",
    "broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
]
