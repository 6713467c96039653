"""`dp-naive`: data parallelism the way the seed first describes it (seed §3.1, 작동 원리).

  1. model replication (모델 복제): every rank builds the same reference model;
  2. data split (데이터 분할): rank r takes its 1/world of the global batch;
  3. parallel processing (병렬 처리): forward and backward on its rows alone;
  4. gradient synchronisation (그래디언트 동기화): after backward, one all-reduce per parameter
     tensor, averaged (the 1/world is applied to each rank's loss, the all-reduce sums);
  5. parameter update (파라미터 업데이트): every rank runs the same AdamW step on the same averaged
     gradient, so the replicas stay identical without ever exchanging weights.

Why it is slow: communication starts only after the whole backward has finished, so none of it is
hidden, and one collective per tensor pays the per-message latency α once per tensor (70 tensors
here). `dp` (refimpl.parallel.dp) fixes both with buckets launched from gradient hooks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.model import Batch, GPT
from refimpl.parallel.data_parallel import DataParallelStrategy
from refimpl.trace.profiling import comm_span, phase
from refimpl.strategy import make_optimizer


class NaiveDataParallel(DataParallelStrategy):
    name = "dp-naive"

    def setup(self, model: GPT) -> None:
        self.model = self.replicate(model)
        self.optimizer = make_optimizer(self.model.parameters(), self.ctx.cfg)

    def train_step(self, batch: Batch) -> float:
        local = self.forward_backward(self.model, batch)
        self.all_reduce_gradients()
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        return self.global_mean_loss(local)

    def all_reduce_gradients(self) -> None:
        # A sum: each rank's loss was already scaled by 1/W (refimpl.parallel.data_parallel).
        for p in self.model.parameters():
            with comm_span("all_reduce", p.grad.nbytes):
                dist.all_reduce(p.grad)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.replicated_state_dict(self.model)

    def model_state(self) -> ModelStateBytes:
        return measured_model_state(self.model.parameters(), self.optimizer)
