"""`zero1` and `zero2`: ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", §5.1-5.2), sharded data parallel (샤드 데이터 병렬화,
seed §3.2).

Plain DP keeps W identical copies of everything. ZeRO removes the redundancy one model state at a
time, over the flat padded buffer of refimpl.parallel.flat_param (rank r owns [r·S, (r+1)·S),
S = ceil(N / W)):

  stage 1 (P_os, 옵티마이저 상태 분할): each rank keeps AdamW's m and v for its shard only and
      updates only its shard of the parameters. It still holds a full gradient buffer, but only
      its own shard of it needs the sum over ranks, so gradients are reduce-scattered, not
      all-reduced; after the step the updated shards are all-gathered into the flat buffer the
      model's parameters view, so every rank again holds the full, identical weights.
  stage 2 (P_os+g, + 그래디언트 분할): a rank only needs the gradient of its own shard, so the
      all-reduce becomes a reduce-scatter (합을 계산한 뒤 결과를 즉시 분산): each rank receives
      just its summed shard and frees the full gradient buffer.

Communication volume per rank and step, in a ring (§7.2.1): all-reduce = reduce-scatter +
all-gather = 2Ψ. Stages 1 and 2 both reduce-scatter the gradients (Ψ) and all-gather the updated
parameters (Ψ): 2Ψ, DP's volume. The two stages differ only in what they keep, not in what they
send. (All-reducing in stage 1 would also work, but would move 3Ψ for nothing.)

Options:
  bucket_mb (25)   with overlap, gradients leave in buckets from hooks during backward
                   (refimpl.parallel.grad_buckets), cut at shard boundaries, each one reduced to
                   the rank that owns it
                   (together those reduces are the reduce-scatter; DeepSpeed's stage 2 does the
                   same, `average_tensor` in deepspeed/runtime/zero/stage_1_and_2.py)
  overlap (true)   false: one reduce_scatter_tensor of the whole flat gradient after backward --
                   the textbook picture, nothing hidden
  offload (false)  ZeRO-Offload (Ren et al. 2021): see refimpl.parallel.sharded_adamw
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.model import Batch, GPT
from refimpl.parallel.data_parallel import DataParallelStrategy
from refimpl.parallel.flat_param import FlatParams
from refimpl.parallel.grad_buckets import GradBuckets, reduce_sum_to_owner
from refimpl.parallel.sharded_adamw import ShardedAdamW
from refimpl.trace.profiling import comm_span, phase
from refimpl.strategy import LayoutError, TrainConfig

MiB = 2 ** 20


class ZeroDataParallel(DataParallelStrategy):
    """What stages 1 and 2 share: flat parameters, the sharded AdamW, the all-gather after it."""

    stage: int = 0
    default_options = {"bucket_mb": 25.0, "overlap": True, "offload": False}

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        if not float(cfg.options.get("bucket_mb", 25.0)) > 0:
            raise LayoutError(f"bucket_mb must be > 0 (got {cfg.options['bucket_mb']})")
        for flag in ("overlap", "offload"):
            if not isinstance(cfg.options.get(flag, False), bool):
                raise LayoutError(f"{flag} must be true or false (got {cfg.options[flag]!r})")

    def setup(self, model: GPT) -> None:
        ctx = self.ctx
        self.model = self.replicate(model)
        self.layout = FlatParams(list(self.model.named_parameters()), ctx.world_size)
        # Every rank keeps the full parameters (stages 1-2 do not shard them), laid out flat so
        # that the updated shards can be all-gathered straight into the model's storage.
        self.flat = self.layout.flatten([p.detach() for p in self.layout.params],
                                        device=ctx.device)
        self.layout.bind(self.flat)
        self.optimizer = ShardedAdamW(self.layout.shard(self.flat, ctx.rank), ctx.cfg,
                                      offload=bool(self.option("offload")))
        self.flat_grad: torch.Tensor | None = None
        self.buckets = None
        if self.option("overlap"):
            self.buckets = GradBuckets(self.layout, float(self.option("bucket_mb")) * MiB,
                                       reduce=self.bucket_collective(), cut_at=self.bucket_cuts())
        self.attach_gradients()

    # --- the parts a stage decides --------------------------------------------------------------

    def bucket_cuts(self) -> list[int]:
        # A bucket never straddles two ranks' shards, so each has exactly one owner to reduce to.
        return [r * self.layout.shard_numel for r in range(1, self.ctx.world_size)]

    def bucket_collective(self):
        """Each bucket is summed onto the rank that owns its range: together, a reduce-scatter."""
        return partial(reduce_sum_to_owner, shard_numel=self.layout.shard_numel)

    def reduce_scatter_flat(self, out: torch.Tensor) -> torch.Tensor:
        """Without buckets: one reduce-scatter of the whole flat gradient into `out`."""
        with comm_span("reduce_scatter", self.flat_grad.nbytes):
            dist.reduce_scatter_tensor(out, self.flat_grad)
        return out

    def reduce_gradients(self) -> torch.Tensor:
        """Make this rank's shard of the averaged gradient; return it."""
        raise NotImplementedError

    # --- the step ---------------------------------------------------------------------------------

    def attach_gradients(self) -> None:
        """A zeroed full flat gradient buffer that autograd accumulates into (.grad are views)."""
        self.flat_grad = self.layout.empty(device=self.ctx.device)
        if self.buckets is not None:
            self.buckets.attach(self.flat_grad)
        else:
            self.layout.bind_grads(self.flat_grad)

    def train_step(self, batch: Batch) -> float:
        if self.flat_grad is None:                       # stage 2 freed it after the last step
            self.attach_gradients()
        micro_step = self.buckets.micro_step if self.buckets is not None else None
        local = self.forward_backward(self.model, batch, micro_step=micro_step)
        if self.buckets is not None:
            self.buckets.wait()
        grad_shard = self.reduce_gradients()
        with phase("optimizer"):
            self.optimizer.step(grad_shard)
            self.all_gather_parameters()
            self.after_step()
        return self.global_mean_loss(local)

    def all_gather_parameters(self) -> None:
        # In place: this rank's shard is already where it belongs in `flat`.
        shard = self.layout.shard(self.flat, self.ctx.rank)
        with comm_span("all_gather", self.flat.nbytes):
            dist.all_gather_into_tensor(self.flat, shard)

    def after_step(self) -> None:
        raise NotImplementedError

    # --- gathering and accounting -----------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.replicated_state_dict(self.model)   # the full weights are on every rank

    def model_state(self) -> ModelStateBytes:
        """Bytes on the compute device. With offload, the fp32 master shard, m, v and the gradient
        shard live in host memory instead (`host_state`): the device keeps the parameters (and, at
        stage 1, the full gradients)."""
        params = list(self.model.parameters())
        if self.optimizer.offload:
            return measured_model_state(params, None)
        return measured_model_state(params + [self.optimizer.master], self.optimizer.optimizer)

    def host_state(self) -> ModelStateBytes:
        return self.optimizer.host_state()


class Zero1(ZeroDataParallel):
    name = "zero1"
    stage = 1

    def reduce_gradients(self) -> torch.Tensor:
        mine = self.layout.shard(self.flat_grad, self.ctx.rank)
        if self.buckets is None:
            # reduce_scatter_tensor's output may not alias its input: reduce, then copy in place.
            mine.copy_(self.reduce_scatter_flat(torch.empty_like(mine)))
        # Only this rank's shard of the full buffer holds the sum over ranks; the rest is this
        # rank's own gradient, which nothing reads. The optimizer reads only the shard.
        return mine

    def after_step(self) -> None:
        self.flat_grad.zero_()


class Zero2(ZeroDataParallel):
    name = "zero2"
    stage = 2

    def setup(self, model: GPT) -> None:
        super().setup(model)
        # The only gradient memory that outlives a step: this rank's shard (device, or host with
        # offload, where ShardedAdamW keeps its own copy).
        self.grad_shard = (None if self.optimizer.offload else
                           torch.zeros(self.layout.shard_numel, device=self.ctx.device))

    def reduce_gradients(self) -> torch.Tensor:
        if self.buckets is None:
            return self.reduce_scatter_flat(self.grad_shard if self.grad_shard is not None else
                                            torch.empty(self.layout.shard_numel,
                                                        device=self.ctx.device))
        # The buckets were reduced to their owners: this rank's shard of flat_grad holds the sum.
        mine = self.layout.shard(self.flat_grad, self.ctx.rank)
        if self.grad_shard is None:
            return mine                     # offload copies it to the host before we free it
        self.grad_shard.copy_(mine)
        return self.grad_shard

    def after_step(self) -> None:
        # Free the full gradients: drop every view and the buffer (stage 2's saving, §5.2).
        for p in self.layout.params:
            p.grad = None
        self.flat_grad = None
        if self.buckets is not None:
            self.buckets.flat_grad = None
