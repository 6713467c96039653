"""ZeRO-3 / FSDP: the parameters are sharded too, gathered unit by unit just before use.

    sharded_unit.py   one unit's flat shard: all-gather before use, reduce-scatter its gradient
    schedule.py       when: the units' hooks (gather, prefetch, free, reduce) over one group
    sharded_module.py FullyShard: that schedule around any nn.Module (a learner's own model)
    zero3.py          zero3: the GPT's units, gathered in forward and again in backward
    fully_shard.py    fsdp: zero3 with prefetch of the next unit (FSDP's design)
"""
from refimpl.parallel.fsdp.sharded_module import FullyShard

__all__ = ["FullyShard"]
