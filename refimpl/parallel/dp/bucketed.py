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

Options: bucket_mb (MiB). The default tiny model (5.6 MB of fp32 gradients) fits one 25 MiB bucket,
so nothing overlaps; try --set bucket_mb=0.25 to see several buckets leave during backward.
"""
from __future__ import annotations

import contextlib
import weakref
from functools import partial

from refimpl.config import Option
from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.model import GPT
from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import GradBuckets, all_reduce_sum
from refimpl.placement import data_parallel_axis
from refimpl.rank_model import RankModel
from refimpl.strategy import Strategy, make_optimizer

MiB = 2 ** 20


class BucketedDataParallel(Strategy):
    name = "dp"
    options = {"bucket_mb": Option(25.0, float, positive=True)}

    experts_over_edp = True
    on_a_pipeline = True

    def setup(self, model: GPT) -> None:
        self.model = model
        # One flat gradient buffer and its buckets per group the gradients are summed over:
        # dp x cp, and (a MoE model under --ep) edp for the experts, which their own buckets keep
        # out of the dense all-reduce. world_size=1: not sharded, so no padding.
        by_axis: dict[str, list] = {}
        for name, p in self.model.named_parameters():
            by_axis.setdefault(data_parallel_axis(p), []).append((name, p))
        self.flat_grads, self.bucket_sets = [], []
        for axis, named in by_axis.items():
            layout = FlatParams(named, world_size=1)
            flat_grad = layout.empty(device=self.ctx.device)
            reduce = partial(all_reduce_sum, group=self.mesh.group(axis), comm=self.comm)
            buckets = GradBuckets(layout, float(self.option("bucket_mb")) * MiB, reduce=reduce)
            buckets.attach(flat_grad)
            self.flat_grads.append(flat_grad)
            self.bucket_sets.append(buckets)
        self.optimizer = make_optimizer(self.model.parameters(), self.ctx.cfg)

    def step_model(self, rank_model: RankModel) -> RankModel:
        """Under a pipeline, the schedule's whole table runs inside one micro-step of the buckets,
        each parameter counted ready at its last accumulation of the step."""
        if rank_model.pipeline is None:
            return rank_model
        per_name = self.model.gradient_accumulations()
        counts = [[per_name[slot.name] for slot in b.layout.slots] for b in self.bucket_sets]
        return rank_model.with_pipeline_run(_armed(rank_model.pipeline.run, self.bucket_sets, counts))

    @contextlib.contextmanager
    def micro_step(self, is_last: bool):
        with contextlib.ExitStack() as stack:   # only the last backward communicates
            for buckets in self.bucket_sets:
                stack.enter_context(buckets.micro_step(is_last))
            yield

    def sync_gradients(self) -> None:
        for buckets in self.bucket_sets:
            buckets.wait()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        for flat_grad in self.flat_grads:
            flat_grad.zero_()            # in place: the .grad views must stay bound

    def model_state(self) -> ModelStateBytes:
        return measured_model_state(self.model.parameters(), self.optimizer)


def _armed(run, bucket_sets: list[GradBuckets], accumulations: list[list[int]]):
    """The pipeline's step (RankModel.pipeline.run) inside one micro-step of every bucket set,
    each expecting its i-th parameter `accumulations[set][i]` times. Holds the buckets weakly
    (GradBuckets says why)."""
    refs = [weakref.ref(b) for b in bucket_sets]

    def armed(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for ref, counts in zip(refs, accumulations):
                stack.enter_context(ref().micro_step(True, counts))
            return run(*args, **kwargs)

    return armed
