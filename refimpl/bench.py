"""Moved to `refimpl.cost.bench`; this name stays because DESIGN.md's contract cites it."""
from refimpl.cost.bench import *  # noqa: F401,F403
from refimpl.cost.bench import busbw_factor, fit_alpha_beta  # noqa: F401
