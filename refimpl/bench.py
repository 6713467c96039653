"""Moved: the sweeps to `refimpl.cost.bench`, the alpha-beta fit and the bus-bandwidth factor to
`refimpl.cost.alpha_beta`; this name stays because DESIGN.md's contract cites it."""
from refimpl.cost.alpha_beta import *  # noqa: F401,F403
from refimpl.cost.alpha_beta import busbw_factor, fit_alpha_beta  # noqa: F401
from refimpl.cost.bench import *  # noqa: F401,F403
