"""`single`: the reference, one process with the whole model and the whole global batch; every
other strategy must reproduce its losses and final weights (fp32: rel. error <= 1e-5)."""
from __future__ import annotations

from refimpl.strategy import Strategy


class Single(Strategy):
    name = "single"
    max_world_size = 1
