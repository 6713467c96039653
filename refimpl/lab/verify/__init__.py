"""Checks of a layout against the reference.

    equivalence.py   same seed, same batch: losses and weights equal to single's, at a stated gate
    reshard.py       a checkpoint written by one layout, loaded by another
    step_time.py     benchmark rounds: several layouts timed in one launch
"""
