"""`dp`: data parallelism as DDP does it -- bucketed all-reduce, overlapped with backward."""
from __future__ import annotations

import weakref

from refimpl.config import Option
from refimpl.model import GPT
from refimpl.parallel.dp.data_parallel import DataParallel
from refimpl.placement import data_parallel_axis
from refimpl.rank_model import RankModel
from refimpl.strategy import Strategy, make_optimizer


class BucketedDataParallel(Strategy):
    name = "dp"
    options = {"bucket_mb": Option(25.0, float, positive=True)}

    experts_over_edp = True
    on_a_pipeline = True

    def setup(self, model: GPT) -> None:
        self.model = model
        mesh = self.mesh
        # summed (each loss was divided by W) over dp x cp, an expert's over edp; no broadcast
        self.ddp = DataParallel(model, bucket_mb=float(self.option("bucket_mb")), average=False,
                                broadcast=False,
                                reduce_over=lambda p: mesh.group(data_parallel_axis(p)))
        self.optimizer = make_optimizer(self.model.parameters(), self.ctx.cfg)

    @property
    def forward_model(self):
        return self.ddp

    def step_model(self, rank_model: RankModel) -> RankModel:
        """Under a pipeline, its whole table runs inside one micro-step of the buckets."""
        if rank_model.pipeline is None:
            return rank_model
        return rank_model.with_pipeline_run(_armed(rank_model.pipeline.run, self.ddp,
                                                   self.model.gradient_accumulations()))

    def micro_step(self, is_last: bool):
        return self.ddp.micro_step(sync=is_last)      # only the last backward communicates

    def sync_gradients(self) -> None:
        self.ddp.finish_gradient_synchronization()


def _armed(run, ddp: DataParallel, accumulations: dict[str, int]):
    """`run` inside one micro-step of `ddp` (held weakly: no cycle through the hooks)."""
    ref = weakref.ref(ddp)

    def armed(*args, **kwargs):
        with ref().micro_step(True, accumulations):
            return run(*args, **kwargs)

    return armed
