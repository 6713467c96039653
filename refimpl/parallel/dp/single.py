"""`single`: the reference. One process, the whole model, the whole global batch.

Every other strategy must reproduce this one's losses and final weights (fp32: rel. error <= 1e-5).
It runs the same step runner as every strategy (refimpl.step): with --micro-batches k it
accumulates gradients over k equal micro-batches, scaling each loss by 1/k so the gradient is
still the mean over the global batch. It has no sync: there is nobody to agree with.
"""
from __future__ import annotations

from refimpl.strategy import Strategy


class Single(Strategy):
    name = "single"
    max_world_size = 1
