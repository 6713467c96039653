"""`dp-naive`: data parallelism the way the seed first describes it (seed §3.1, 작동 원리)."""
from __future__ import annotations

from refimpl.config import Option
from refimpl.placement import data_parallel_axis
from refimpl.seam import dist
from refimpl.strategy import Strategy


class NaiveDataParallel(Strategy):
    name = "dp-naive"
    experts_over_edp = True
    on_a_pipeline = True
    # The `tp` shorthand runs on this flavour, so its tensor-parallel knob lives here: under SP,
    # each all-gather / reduce-scatter decomposed under its matmul (refimpl.lab.tensor, a plug-in).
    options = {"tp_overlap": Option(False, bool)}

    def sync_gradients(self) -> None:
        for p in self.model.parameters():
            # over dp x cp; an expert's over edp, the ranks holding the same expert (--ep)
            group = self.mesh.group(data_parallel_axis(p))
            if group is not None:
                dist.all_reduce(p.grad, group=group)
