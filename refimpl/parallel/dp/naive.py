"""`dp-naive`: data parallelism the way the seed first describes it (seed §3.1, 작동 원리).

  1. model replication (모델 복제): every rank builds the same reference model;
  2. data split (데이터 분할): data-parallel rank r takes its 1/dp of the global batch;
  3. parallel processing (병렬 처리): forward and backward on its rows alone;
  4. gradient synchronisation (그래디언트 동기화): after backward, one all-reduce per parameter
     tensor over the dp axis, summed (the 1/W of the average was applied to each rank's loss:
     refimpl.strategy's docstring says why); on a MoE model with --ep, an expert's gradient only
     over the ranks holding that expert (refimpl.placement.data_parallel_axis);
  5. parameter update (파라미터 업데이트): every rank runs the same AdamW step on the same averaged
     gradient, so the replicas stay identical without ever exchanging weights.

Why it is slow: communication starts only after the whole backward has finished, so none of it is
hidden, and one collective per tensor pays the per-message latency α once per tensor (70 tensors
here). `dp` (refimpl.parallel.dp.bucketed) fixes both with buckets launched from gradient hooks.
"""
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
    # each all-gather / reduce-scatter decomposed under its matmul (refimpl.parallel.tp.overlap).
    options = {"tp_overlap": Option(False, bool)}

    def sync_gradients(self) -> None:
        for p in self.model.parameters():
            # over dp x cp; an expert's over edp, the ranks holding the same expert (--ep)
            group = self.mesh.group(data_parallel_axis(p))
            if group is not None:
                dist.all_reduce(p.grad, group=group)
