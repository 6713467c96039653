"""DESIGN.md's contract names `refimpl.bench.busbw_factor` and `refimpl.bench.fit_alpha_beta`; both live
in `refimpl.cost.alpha_beta`. The sweeps that measure them are the lab's (`refimpl.lab.measure.bench`)."""
from refimpl.cost.alpha_beta import busbw_factor, fit_alpha_beta  # noqa: F401
