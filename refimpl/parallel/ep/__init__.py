"""Expert parallelism: each rank of an ep group holds E/ep experts; tokens travel by all-to-all.

    dispatch.py      the transform and the all-to-all dispatch/combine (GShard's)
    counts.py        the routing counts gathered over the ranks holding the other tokens

The MoE layer itself (router, capacity, balancing) is architecture: refimpl.model.moe.
"""
