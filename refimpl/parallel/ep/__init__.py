"""Expert parallelism: each rank of an ep group holds E/ep experts; tokens travel by all-to-all.

    dispatch.py      the transform and the all-to-all dispatch/combine (GShard's)
    strategy.py      --strategy ep: expert gradients synced only over ranks holding the same experts
    load.py          expert load over steps (notebook 08)

The MoE layer itself (router, capacity, balancing) is architecture: refimpl.model.moe.
"""
