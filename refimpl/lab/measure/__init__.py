"""Measurements and sweeps over the core: each runs a mechanism and reads what it did."""
