"""Collective communication rebuilt from point-to-point send/recv, as drop-in twins of torch's.

`refimpl.comm.all_reduce(t, op, group, async_op)` takes the same arguments as
`torch.distributed.all_reduce` and leaves the same result in the same place, so either can be
swapped for the other in any strategy. Only `torch.distributed.isend/irecv` move data.

    name                      algorithm                         file
    broadcast, reduce         binomial tree                     tree.py
    all_reduce                ring = reduce-scatter + all-gather  ring.py
    all_reduce(algorithm="halving-doubling")  recursive halving + doubling  halving_doubling.py
    reduce_scatter(_tensor)   ring                              ring.py
    all_gather(_into_tensor)  ring                              ring.py
    scatter, gather           root talks to each rank directly  linear.py
    all_to_all(_single)       pairwise exchange                 pairwise.py
    send, recv, isend, irecv  torch's own, counted              p2p.py

`async_op=True` returns a `Work` whose `.wait()` blocks until the result is in place (work.py).
Each collective and message passes refimpl.seam's `span`/`message`, where the lab attaches its
instruments (refimpl/lab/instrument/).
"""
from torch.distributed import ReduceOp

from refimpl.comm.linear import gather, scatter
from refimpl.comm.p2p import irecv, isend, recv, send
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
    "send", "recv", "isend", "irecv",
]
