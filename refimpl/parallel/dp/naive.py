"""`dp-naive`: data parallelism as the seed first describes it (seed §3.1, 작동 원리): after
backward, one all-reduce of every gradient."""
from __future__ import annotations

from refimpl.config import Option
from refimpl.placement import data_parallel_axis
from refimpl.seam import dist
from refimpl.strategy import Strategy


class NaiveDataParallel(Strategy):
    name = "dp-naive"
    options = {"tp_overlap": Option(False, bool)}   # the `tp` shorthand's knob (refimpl.lab.tensor)

    def sync_gradients(self) -> None:
        for p in self.model.parameters():
            group = self.mesh.group(data_parallel_axis(p))   # dp x cp; an expert's: edp
            if group is not None:
                dist.all_reduce(p.grad, group=group)
