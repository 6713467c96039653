"""ZeRO stages 1 and 2 over one data-parallel group (Rajbhandari et al. 2020, §5.1-5.2; seed §3.2,
샤드 데이터 병렬화). Rank r owns [r·S, (r+1)·S) of the flat parameters, S = ceil(Ψ/N). One step:
1. reduce-scatter the gradient, 2. the optimizer on this rank's shard, 3. all-gather the shards."""
from __future__ import annotations

import contextlib

import torch

from refimpl.parallel.dp.grad_buckets import Bucket, GradBuckets
from refimpl.parallel.zero.sharded_optimizer import ShardedOptimizer
from refimpl.parallel.zero.streaming_reduce import StreamingReduce
from refimpl.seam import dist


class ZeroShards:
    """Both stages: a flat ShardedOptimizer and this rank's `grad_shard`. `group` None: one rank
    holds everything. A subclass's `bucket_bytes` None: one reduce-scatter after backward."""

    def __init__(self, optimizer: ShardedOptimizer, group):
        self.optimizer, self.group = optimizer, group
        self.layout, self.index, self.device = optimizer.layout, optimizer.rank, optimizer.flat.device

    def reduce_scatter(self, flat_grad: torch.Tensor) -> None:
        """1. The flat gradient summed over the group; this rank keeps its shard."""
        summed = flat_grad.new_empty(self.layout.shard_numel)   # the output may not alias the input
        if self.group is None:
            summed.copy_(flat_grad)
        else:
            dist.reduce_scatter_tensor(summed, flat_grad, group=self.group)
        self.grad_shard.copy_(summed)

    def step(self) -> None:
        """2. The optimizer on this rank's shard; 3. the all-gather of every updated shard."""
        self.optimizer.step_shard(self.grad_shard)
        if self.group is not None:      # in place: this rank's shard is already where it belongs
            dist.all_gather_into_tensor(self.optimizer.flat, self.optimizer.shard, group=self.group)
        self.grad_shard.zero_()

    def reduce_to_owner(self, bucket: Bucket, grads: torch.Tensor):
        """A bucket's collective (bucketed step 1): summed onto the rank whose shard holds it."""
        if self.group is None:
            return None
        owner = dist.get_global_rank(self.group, bucket.start // self.layout.shard_numel)
        return dist.reduce(grads, dst=owner, group=self.group, async_op=True)

    def bucket_cuts(self) -> list[int]:
        # a bucket never straddles two shards: each has one owner
        return [r * self.layout.shard_numel for r in range(1, self.optimizer.world_size)]


class Zero1Shards(ZeroShards):
    """Stage 1: full gradients accumulate in one flat buffer; only this rank's shard is summed."""

    def __init__(self, optimizer: ShardedOptimizer, group, bucket_bytes: float | None):
        super().__init__(optimizer, group)
        self.flat_grad = self.layout.empty(device=self.device)
        self.grad_shard = self.layout.shard(self.flat_grad, self.index)   # a view: no copy
        self.buckets = None
        if bucket_bytes is None:
            self.layout.bind_grads(self.flat_grad)
        else:
            self.buckets = GradBuckets(self.layout, bucket_bytes, reduce=self.reduce_to_owner,
                                       cut_at=self.bucket_cuts())
            self.buckets.attach(self.flat_grad)

    def micro_step(self, is_last: bool):
        return contextlib.nullcontext() if self.buckets is None else self.buckets.micro_step(is_last)

    def finish_gradient_synchronization(self) -> None:
        if self.buckets is None:
            self.reduce_scatter(self.flat_grad)
        else:       # each bucket went to its owner: this rank's shard of flat_grad holds the sum
            self.buckets.wait()

    def step(self) -> None:
        super().step()
        self.flat_grad.zero_()


class Zero2Shards(ZeroShards):
    """Stage 2: no full gradient buffer; with buckets, each leaves during backward and is freed."""

    def __init__(self, optimizer: ShardedOptimizer, group, bucket_bytes: float | None):
        super().__init__(optimizer, group)
        # the only gradient memory outliving a step (on the host under offload)
        self.grad_shard = (optimizer.master.grad if optimizer.offload else torch.zeros(
            self.layout.shard_numel, dtype=self.layout.dtype, device=self.device))
        self.stream = None if bucket_bytes is None else StreamingReduce(
            self.layout, bucket_bytes, self.bucket_cuts(), self.reduce_to_owner,
            self.grad_shard, self.index)

    def micro_step(self, is_last: bool):
        if self.stream is not None:
            self.stream.arm(sync=True)   # every micro-batch's gradients go out (and are freed)
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        if self.stream is not None:
            self.stream.wait()
            return
        # without buckets: flatten autograd's full gradients, free them, reduce-scatter
        self.reduce_scatter(self.layout.take_grads(device=self.device))
