"""The data-parallel gradient sync of one step, per ZeRO stage: what predict_time adds after the
pipeline (refimpl.lab.plan.predict). Collective times are refimpl.cost.alpha_beta.ring_seconds'.

  stage 0   one all-reduce of the gradients after the last backward (DDP's buckets overlap all
            but about one of them on a GPU: the exposed one is the model's).
  stage 1   a reduce-scatter after the last backward, an all-gather of the updated parameters
            after the optimizer (ZeRO §5.1; Megatron's distributed optimizer).
  stage 2   the gradients are sharded, so no rank can hold a micro-batch's full gradient until the
            next one adds to it: every micro-batch reduce-scatters what its backward produced
            (ZeRO §5.2, "we reduce the gradients ... and release the memory of the gradients not
            owned by the rank"; DeepSpeed's stage 2 does so every micro-step, which is why its
            pipeline engine refuses stage 2). The buckets overlap that micro-batch's backward
            where the hardware overlaps; the rest is exposed, m times. `per_micro_batch=False`
            is refimpl's zero2 under a pipeline: one reduce-scatter after the schedule, the full
            gradients kept meanwhile (refimpl/parallel/zero/stages.py).
  stage 3   each unit (a block; the embedding and the head) all-gathers its parameters forward
            and backward and reduce-scatters its gradients, every micro-batch; prefetching hides
            them behind that micro-batch's compute where they fit (ZeRO §5.3).
`messages` cuts a sync into that many collectives (k times alpha, the same bytes): refimpl's
per-tensor and per-owner syncs on CPU ranks (refimpl.lab.plan.cpu.grad_messages).
"""
from __future__ import annotations

from refimpl.cost.alpha_beta import ring_seconds


def dp_sync_seconds(zero_stage: int, *, param_count: float, param_bytes: int, grad_bytes: int,
                    ranks: int, alpha: float, beta: float, micro_batches: int, units: int,
                    backward_s: float, micro_batch_s: float, messages: int = 1,
                    per_micro_batch: bool = True) -> float:
    """Seconds of the step's data-parallel sync that compute does not hide. `backward_s` and
    `micro_batch_s`: one micro-batch's backward and whole pass as far as they can hide
    communication (0 where nothing overlaps, as on CPU ranks)."""
    grads, params, k, m = param_count * grad_bytes, param_count * param_bytes, messages, micro_batches

    def reduce_scatter():
        return k * ring_seconds("reduce_scatter", grads / k, ranks, alpha, beta)

    if zero_stage == 0:
        return k * ring_seconds("all_reduce", grads / k, ranks, alpha, beta)
    gather = ring_seconds("all_gather", params, ranks, alpha, beta)
    if zero_stage == 1 or (zero_stage == 2 and not per_micro_batch):
        return reduce_scatter() + gather
    if zero_stage == 2:
        return m * max(0.0, reduce_scatter() - backward_s) + gather
    per_unit = (2 * ring_seconds("all_gather", params / units, ranks, alpha, beta)
                + ring_seconds("reduce_scatter", grads / units, ranks, alpha, beta))
    return m * max(0.0, units * per_unit - micro_batch_s)
