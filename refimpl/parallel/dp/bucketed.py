"""`dp`: data parallelism as DDP does it -- bucketed all-reduce, overlapped with backward.

Same maths as `dp-naive` (replicate, split the batch, average the gradients, identical AdamW step
on every rank), different schedule (Li et al. 2020, "PyTorch Distributed", §3.2):

  * gradients live in one flat buffer cut into buckets of `bucket_mb` MiB (default 25, as DDP);
    each parameter's .grad is a view into it, so there is no copy in or out of a bucket;
  * a bucket's all-reduce is launched asynchronously (async_op=True) from the gradient hook of its
    last parameter, while autograd still computes the gradients of earlier layers; the buckets go
    out in reverse parameter order, the same order on every rank;
  * every handle is waited on before the optimizer step;
  * with --micro-batches k, the rank's rows are split into k micro-batches whose gradients
    accumulate locally; only the last backward communicates (DDP's `no_sync`);
  * a MoE model under --ep keeps its experts' gradients in a second buffer whose buckets are
    all-reduced over "edp", the ranks holding the same experts (refimpl.placement).

Under a pipeline (--pp, any schedule) the step's whole table is one micro-step: each stage's
parameters are counted ready at their last accumulation of the step (the last B of their chunk, or
the last W under a split schedule: refimpl.parallel.pp.stage's `gradient_accumulations`), so each
stage's buckets leave during its cool-down, while its remaining backwards still compute.

The mechanism is refimpl.parallel.dp.DataParallel, the wrapper for any nn.Module, around this
rank's GPT with the loop's options (summed rather than averaged gradients, no broadcast).

Options: bucket_mb (MiB). The default tiny model (5.6 MB of fp32 gradients) fits one 25 MiB bucket,
so nothing overlaps; try --set bucket_mb=0.25 to see several buckets leave during backward.
"""
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
        # refimpl.parallel.dp.DataParallel, the wrapper a learner puts around a model of their own,
        # with the loop's choices: the gradients summed (each rank's loss was divided by W), over
        # dp x cp -- and a MoE model's experts (--ep) over edp, in buckets of their own -- every
        # rank already holding the same model (no broadcast), through the collectives' seam.
        self.ddp = DataParallel(model, bucket_mb=float(self.option("bucket_mb")), average=False,
                                broadcast=False, comm=self.comm,
                                reduce_over=lambda p: mesh.group(data_parallel_axis(p)))
        self.optimizer = make_optimizer(self.model.parameters(), self.ctx.cfg)

    @property
    def forward_model(self):
        return self.ddp

    def step_model(self, rank_model: RankModel) -> RankModel:
        """Under a pipeline, the schedule's whole table runs inside one micro-step of the buckets,
        each parameter counted ready at its last accumulation of the step."""
        if rank_model.pipeline is None:
            return rank_model
        return rank_model.with_pipeline_run(_armed(rank_model.pipeline.run, self.ddp,
                                                   self.model.gradient_accumulations()))

    def micro_step(self, is_last: bool):
        return self.ddp.micro_step(sync=is_last)      # only the last backward communicates

    def sync_gradients(self) -> None:
        self.ddp.finish_gradient_synchronization()


def _armed(run, ddp: DataParallel, accumulations: dict[str, int]):
    """The pipeline's step (RankModel.pipeline.run) inside one micro-step of the wrapper, each
    parameter expected `accumulations[name]` times. Holds the wrapper weakly (GradBuckets says why)."""
    ref = weakref.ref(ddp)

    def armed(*args, **kwargs):
        with ref().micro_step(True, accumulations):
            return run(*args, **kwargs)

    return armed
