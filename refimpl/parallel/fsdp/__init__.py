"""ZeRO-3 / FSDP: the parameters are sharded too, gathered unit by unit just before use.

    sharded_unit.py   one unit's flat shard: all-gather before use, reduce-scatter its gradient
    sharded_module.py FullyShard: the units' schedule around any nn.Module (a learner's own model)
    zero3.py          zero3: FullyShard around the GPT, every block a unit, gathered in forward and again in backward
    fully_shard.py    fsdp: zero3 with prefetch of the next unit (FSDP's design)
    torch_fsdp2.py    torch-fsdp2: PyTorch's fully_shard, the twin
"""
from refimpl.parallel.fsdp.sharded_module import FullyShard

__all__ = ["FullyShard"]
