"""Pipeline parallelism: each rank holds consecutive blocks; micro-batches flow through a schedule.

    actions.py       a table's words: F/B/W actions, overlapped F&B pairs, the chunks' placement
    schedules.py     the schedules as tables (GPipe, 1F1B, interleaved, ZB-H1) and their bubbles
    frontier.py      interleaved-zb, ZB-V and DualPipeV (the V placement)
    simulate.py      replay a table with per-action costs
    stage.py         the transform: this rank's stage (chunks) of the reference model
    runner.py        one runner for any table: send/recv between stages, F, B, W
    zero_bubble.py   the B/W split: weight gradients deferred (Qi et al. 2023)
    strategy.py      --strategy pp-*, the pipeline's layout checks
    torch_pp.py      torch.distributed.pipelining's schedules on the same stages, the twin
    measure.py       the measured bubble (notebook 07)
    weight_stashing.py  PipeDream without a flush: why it stashes weight versions

`refimpl.parallel.pp.schedule_table` / `bubble_fraction` are a DESIGN contract.
"""
from refimpl.parallel.pp.schedules import bubble_fraction, schedule_table

__all__ = ["schedule_table", "bubble_fraction"]
