"""`ep`: expert parallelism over the data-parallel ranks (GShard's layout; Megatron's EP over DP).

    python -m refimpl train --strategy ep --nproc 4 --experts 8 --top-k 2

Every rank of the dp x cp group takes its rows of the global batch, as in data parallelism; inside
each chunk of `ep` consecutive ranks, the experts are spread E/ep per rank
(refimpl.parallel.ep.dispatch: tokens reach their experts by all-to-all). So a rank holds:

    non-expert parameters (attention, norms, router, embeddings)  replicated: gradients summed
                                                                  over every dp x cp rank
    expert parameters (E/ep experts of each MoE layer)            its own: every token that chose
                                                                  them sent its gradient back
                                                                  through the all-to-all; summed
                                                                  only over "edp", the ranks of
                                                                  the other chunks holding the
                                                                  same experts

Averaging an expert's gradient over dp x cp would mix expert 0's gradient into expert 2's weights:
that is the one rule expert parallelism adds to data parallelism. Every data-parallel flavour of
ours keeps it (refimpl.placement.data_parallel_axis): `--ep E` with dp-naive or dp replicates
and sums the experts over edp, with zero1/2/3 or fsdp shards them over edp (and the dense
parameters over dp x cp), as Megatron-core's distributed optimizer does; `ep` is dp-naive's
sync spelled out, the name of the layout. With `--tp` each expert is split over tp as well
(refimpl.parallel.tp.experts). PyTorch's twins sum over dp x cp, so they refuse `--ep`.

Equal to `single` with the same experts (tests/test_ep_strategy.py, tests/test_moe_compose.py),
dropped tokens included, because capacity and the aux loss's f_i are computed over the whole
global batch (capacity_scope=batch), or per sequence (capacity_scope=sequence). With
`--micro-batches m > 1` the batch scope counts per micro-batch, and a rank's i-th micro-batch is
not single's i-th: validation then asks for capacity_scope=sequence unless nothing can overflow
and balance != aux (refimpl.model.moe_layout.batch_scope_problem). The bias is nudged from the
whole step's load. `--strategy ep --nproc N` puts the whole world on one ep group (ep = N,
edp = 1); `--ep E` with a larger dp keeps E per chunk. It composes with the other axes:
`--cp` (tokens from every dp x cp rank, experts spread over ep inside dp x cp) and `--pp` with any
schedule (`--schedule`, each stage's experts spread over its own dp x cp ranks; the gradients
synced after the schedule, as dp-naive's).
"""
from __future__ import annotations

from refimpl.config import TrainConfig
from refimpl.mesh import LayoutError
from refimpl.placement import data_parallel_axis
from refimpl.strategy import Strategy
from refimpl.trace.labels import comm_span


class ExpertParallel(Strategy):
    name = "ep"
    experts_over_edp = True

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        if cfg.model.n_experts == 0:
            raise LayoutError("strategy 'ep' needs --experts E > 0")

    def sync_gradients(self) -> None:
        for p in self.model.parameters():
            group = self.mesh.group(data_parallel_axis(p))   # experts: "edp"; the rest "dp_cp"
            if group is not None:
                with comm_span("all_reduce", p.grad.nbytes):
                    self.comm.all_reduce(p.grad, group=group)
