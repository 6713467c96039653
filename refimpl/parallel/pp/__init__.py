"""Pipeline parallelism: each rank holds consecutive blocks; micro-batches flow through a schedule.

    actions.py       a table's words: F/B/W actions, overlapped F&B pairs, the chunks' placement
    schedules.py     the schedules as tables (GPipe, 1F1B, interleaved, ZB-H1) and their bubbles
    frontier.py      interleaved-zb, ZB-V and DualPipeV (the V placement)
    stage.py         the transform: this rank's stage (chunks) of the reference model
    runner.py        one runner for any table: F, B, W
    links.py         its sends and receives, posted in the step's one order (order.py)
    zero_bubble.py   the B/W split: weight gradients deferred (Qi et al. 2023)
    validate.py      the pipeline's layout checks

`refimpl.parallel.pp.schedule_table` / `bubble_fraction` are a DESIGN contract. The replay, the
checks and the measured bubble are the lab's (refimpl.lab.pipeline, refimpl.lab.measure.pp_*).
"""
from refimpl.parallel.pp.schedules import bubble_fraction, schedule_table

__all__ = ["schedule_table", "bubble_fraction"]
