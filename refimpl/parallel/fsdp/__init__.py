"""ZeRO-3 / FSDP: the parameters are sharded too, gathered unit by unit just before use
(sharded_unit.py: one unit; schedule.py: when; zero3.py: the strategies zero3 and fsdp)."""
from refimpl.parallel.fsdp.sharded_module import FullyShard

__all__ = ["FullyShard"]
