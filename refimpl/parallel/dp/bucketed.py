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
    accumulate locally; only the last backward communicates (DDP's `no_sync`).

Under a pipeline (--pp, any schedule) the step's whole table is one micro-step: each stage's
parameters are counted ready at their last accumulation of the step (the last B of their chunk, or
the last W under a split schedule: refimpl.parallel.pp.stage's `gradient_accumulations`), so each
stage's buckets leave during its cool-down, while its remaining backwards still compute.

Options: bucket_mb (MiB). The default tiny model (5.6 MB of fp32 gradients) fits one 25 MiB bucket,
so nothing overlaps; try --set bucket_mb=0.25 to see several buckets leave during backward.
"""
from __future__ import annotations

import weakref
from functools import partial

from refimpl.config import Option
from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.model import GPT
from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import GradBuckets, all_reduce_sum
from refimpl.strategy import Strategy, make_optimizer

MiB = 2 ** 20


class BucketedDataParallel(Strategy):
    name = "dp"
    options = {"bucket_mb": Option(25.0, float, positive=True)}

    def setup(self, model: GPT) -> None:
        self.model = model
        # world_size=1: the gradients are not sharded, so the flat buffer needs no padding.
        layout = FlatParams(list(self.model.named_parameters()), world_size=1)
        self.flat_grad = layout.empty(device=self.ctx.device)
        reduce = partial(all_reduce_sum, group=self.mesh.group("dp_cp"), comm=self.comm)
        self.buckets = GradBuckets(layout, float(self.option("bucket_mb")) * MiB, reduce=reduce)
        self.buckets.attach(self.flat_grad)
        self.optimizer = make_optimizer(self.model.parameters(), self.ctx.cfg)
        pipeline = self.rank_model.pipeline
        if pipeline is not None:
            per_name = model.gradient_accumulations()
            counts = [per_name[slot.name] for slot in layout.slots]
            self.rank_model.pipeline = _armed(pipeline, self.buckets, counts)

    def micro_step(self, is_last: bool):
        return self.buckets.micro_step(is_last)     # only the last backward communicates

    def sync_gradients(self) -> None:
        self.buckets.wait()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.flat_grad.zero_()           # in place: the .grad views must stay bound

    def model_state(self) -> ModelStateBytes:
        return measured_model_state(self.model.parameters(), self.optimizer)


def _armed(pipeline, buckets: GradBuckets, accumulations: list[int]):
    """The pipeline's step (RankModel.pipeline) inside one micro-step of `buckets` that expects
    each parameter `accumulations[i]` times. Holds the buckets weakly (GradBuckets says why)."""
    ref = weakref.ref(buckets)

    def run(*args, **kwargs):
        with ref().micro_step(True, accumulations):
            return pipeline(*args, **kwargs)

    run.loss_stage = pipeline.loss_stage
    return run
