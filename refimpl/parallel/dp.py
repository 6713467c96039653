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

Options: bucket_mb (MiB). The default tiny model (5.6 MB of fp32 gradients) fits one 25 MiB bucket,
so nothing overlaps; try --set bucket_mb=0.25 to see several buckets leave during backward.
"""
from __future__ import annotations

import torch

from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.model import Batch, GPT
from refimpl.parallel.data_parallel import DataParallelStrategy
from refimpl.parallel.flat_param import FlatParams
from refimpl.parallel.grad_buckets import GradBuckets, all_reduce_sum
from refimpl.trace.profiling import phase
from refimpl.strategy import LayoutError, TrainConfig, make_optimizer

MiB = 2 ** 20


class BucketedDataParallel(DataParallelStrategy):
    name = "dp"
    default_options = {"bucket_mb": 25.0}

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        if not float(cfg.options.get("bucket_mb", 25.0)) > 0:
            raise LayoutError(f"bucket_mb must be > 0 (got {cfg.options['bucket_mb']})")

    def setup(self, model: GPT) -> None:
        self.model = self.replicate(model)
        # world_size=1: the gradients are not sharded, so the flat buffer needs no padding.
        layout = FlatParams(list(self.model.named_parameters()), world_size=1)
        self.flat_grad = layout.empty(device=self.ctx.device)
        self.buckets = GradBuckets(layout, float(self.option("bucket_mb")) * MiB,
                                   reduce=all_reduce_sum)
        self.buckets.attach(self.flat_grad)
        self.optimizer = make_optimizer(self.model.parameters(), self.ctx.cfg)

    def train_step(self, batch: Batch) -> float:
        local = self.forward_backward(self.model, batch, micro_step=self.buckets.micro_step)
        self.buckets.wait()
        with phase("optimizer"):
            self.optimizer.step()
            self.flat_grad.zero_()           # in place: the .grad views must stay bound
        return self.global_mean_loss(local)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.replicated_state_dict(self.model)

    def model_state(self) -> ModelStateBytes:
        return measured_model_state(self.model.parameters(), self.optimizer)
