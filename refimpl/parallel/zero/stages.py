"""`zero1` and `zero2`: ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", §5.1-5.2), sharded data parallel (샤드 데이터 병렬화,
seed §3.2).

Plain DP keeps W identical copies of everything. ZeRO removes the redundancy one model state at a
time, over the flat padded buffer of refimpl.parallel.dp.flat_param (rank r owns [r·S, (r+1)·S),
S = ceil(N / W)):

  stage 1 (P_os, 옵티마이저 상태 분할): each rank keeps AdamW's m and v for its shard only and
      updates only its shard of the parameters. It still holds a full gradient buffer, but only
      its own shard of it needs the sum over ranks, so gradients are reduce-scattered, not
      all-reduced; after the step the updated shards are all-gathered into the flat buffer the
      model's parameters view, so every rank again holds the full, identical weights.
  stage 2 (P_os+g, + 그래디언트 분할): a rank only needs the gradient of its own shard, so it
      never holds a full gradient buffer: during backward each bucket of gradients is copied out
      of autograd's .grad tensors, reduced to the rank that owns it (합을 계산한 뒤 결과를 즉시
      분산), and the full-size gradients it came from are freed at once; the owner adds the sum
      into its gradient shard. At every moment a rank holds its Ψ/N gradient shard plus the
      buckets in flight and the gradients of layers whose bucket is not full yet (§5.2: "we
      reduce the gradients ... and release the memory of the gradients not owned by the rank").
      Stage 1 keeps the full buffer until the step ends: its transient peak is higher by about
      (1 - 1/N) of the gradient bytes, which notebook 04 measures.

Communication volume per rank and step, in a ring (§7.2.1; bytes per collective in refimpl.cost.collective_bytes): all-reduce = reduce-scatter +
all-gather = 2Ψ. Stages 1 and 2 both reduce-scatter the gradients (Ψ) and all-gather the updated
parameters (Ψ): 2Ψ, DP's volume. The two stages differ only in what they keep, not in what they
send. (All-reducing in stage 1 would also work, but would move 3Ψ for nothing.)

The partitioned optimizer states are `ShardedOptimizer(partition="flat")`
(refimpl.parallel.zero.sharded_optimizer, P_os for a learner's own model too): it lays the
parameters out in the flat buffer, steps this rank's shard with AdamW (elementwise, so a slice is
stepped as `single` steps those elements) and all-gathers the buffer. Its flat partition, not its
whole-tensor one, because the flat one gives every rank exactly ceil(Ψ/N) elements, the bytes
`model_state_bytes` predicts, in shards a reduce-scatter can fill; the whole-tensor partition's
shares are only roughly 1/N (none smaller than the GPT's embedding or lm_head). What the stages
add is the gradient path: each rank's summed gradient shard, handed to `step_shard`.

Options:
  bucket_mb (25)   with overlap, gradients leave in buckets from hooks during backward
                   (refimpl.parallel.dp.grad_buckets), cut at shard boundaries, each one reduced to
                   the rank that owns it (together those reduces are the reduce-scatter;
                   DeepSpeed's stage 2 does the same, `average_tensor` in its stage_1_and_2.py)
  overlap (true)   false: one reduce_scatter_tensor of the whole flat gradient after backward --
                   the textbook picture, nothing hidden (and, at stage 2, the full gradients
                   held until backward ends)
  offload (false)  ZeRO-Offload (Ren et al. 2021): see refimpl.parallel.zero.sharded_optimizer
"""
from __future__ import annotations

import contextlib
import weakref
from functools import partial

import torch

from refimpl.config import Option
from refimpl.faults import injected
from refimpl.labels import comm_span
from refimpl.memory import ModelStateBytes, optimizer_state_tensors, tensor_bytes
from refimpl.model import GPT
from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import GradBuckets, assign_buckets, reduce_sum_to_owner
from refimpl.parallel.zero.sharded_optimizer import ShardedOptimizer
from refimpl.placement import data_parallel_axis
from refimpl.rank_values import RankValues
from refimpl.strategy import Strategy, optimizer_settings

MiB = 2 ** 20


class ZeroDataParallel(Strategy):
    """What stages 1 and 2 share: flat parameters sharded over the dp x cp ranks of the mesh, and
    the optimizer over them (ShardedOptimizer's flat partition: AdamW on this rank's shard, then
    the all-gather of the updated shards).

    A MoE model under --ep has two such partitions, each an instance of this class over its own
    parameters (`parts`): the dense ones sharded over dp x cp, the experts over "edp", the ranks
    holding the same experts (refimpl.placement.data_parallel_axis) -- Megatron-core's distributed
    optimizer likewise keeps expert parameters in buffers of their own over the expert-data-
    parallel group. The first partition is this object itself, so a dense model has one, here."""

    options = {"bucket_mb": Option(25.0, float, positive=True), "overlap": Option(True, bool),
               "offload": Option(False, bool)}
    experts_over_edp = True
    on_a_pipeline = True
    builds_own_parameters = True   # written into the flat buffer one by one (setup_shards)

    def setup(self, model: GPT, values: RankValues | None = None) -> None:
        self.model = model
        by_axis: dict[str, list] = {}
        for name, p in model.named_parameters():
            by_axis.setdefault(data_parallel_axis(p), []).append((name, p))
        self.parts = []
        for axis, named in by_axis.items():
            part = self if not self.parts else type(self)(self.ctx)
            part.model = model
            part.setup_shards(named, axis, values)
            self.parts.append(part)

    def setup_shards(self, named: list, axis: str, values: RankValues | None = None) -> None:
        ctx = self.ctx
        self.axis = axis
        self.group = self.mesh.group(axis)       # None: the axis has one rank
        # Every rank keeps the full parameters (stages 1-2 do not shard them), laid out flat by
        # the optimizer so that the updated shards are all-gathered straight into the model's
        # storage. Each parameter's value is made as the buffer is filled (one at a time, on the
        # host), so the parameters are never held twice (refimpl.rank_values).
        cls, settings = optimizer_settings(ctx.cfg)
        self.optimizer = ShardedOptimizer(
            named, cls, group=self.group, partition="flat", offload=bool(self.option("offload")),
            comm=self.comm, values=values, device=ctx.device, alone=self.group is None,
            **settings)
        self.layout = self.optimizer.layout
        self.index, self.size = self.optimizer.rank, self.optimizer.world_size
        self.setup_gradients()      # sets self.grad_shard: this rank's slice of the summed gradient

    def setup_gradients(self) -> None:
        raise NotImplementedError

    @property
    def overlap(self) -> bool:
        """Bucketed reduces during backward, gated by micro_step. A pipeline's schedule runs its
        backwards without micro_step (and interleaves micro-batches), so under pp the gradients
        are reduce-scattered once, after the schedule (the `overlap=false` path)."""
        return (bool(self.option("overlap")) and self.mesh.size("pp") == 1
                and not injected(self.ctx.cfg, "zero1-unsynced"))   # the fault's path: no buckets

    def bucket_cuts(self) -> list[int]:
        # A bucket never straddles two ranks' shards, so each has exactly one owner to reduce to.
        return [r * self.layout.shard_numel for r in range(1, self.size)]

    def bucket_reduce(self):
        """Each bucket is summed onto the rank that owns its range: together, a reduce-scatter."""
        return partial(reduce_sum_to_owner, shard_numel=self.layout.shard_numel,
                       owners=self.mesh.ranks(self.axis), group=self.group, comm=self.comm)

    def reduce_scatter_into(self, out: torch.Tensor, flat_grad: torch.Tensor) -> None:
        """Without buckets: one reduce-scatter of the whole flat gradient into `out`."""
        if self.group is None:
            out.copy_(flat_grad)
            return
        with comm_span("reduce_scatter", flat_grad.nbytes):
            self.comm.reduce_scatter_tensor(out, flat_grad, group=self.group)

    # --- the runner's hooks: each partition's part, in partition order ----------------------------

    @contextlib.contextmanager
    def micro_step(self, is_last: bool):
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.part_micro_step(is_last))
            yield

    def sync_gradients(self) -> None:
        for part in self.parts:
            part.part_sync()

    def optimizer_step(self) -> None:
        for part in self.parts:
            part.part_step()

    def part_micro_step(self, is_last: bool):
        return contextlib.nullcontext()

    def part_sync(self) -> None:
        raise NotImplementedError

    def part_step(self) -> None:
        self.optimizer.step_shard(self.grad_shard)      # AdamW on the shard, then the all-gather
        self.grad_shard.zero_()

    def model_state(self) -> ModelStateBytes:
        """Bytes on the compute device. With offload, the fp32 master shard, m and v live in host
        memory instead (`host_state`): the device keeps the parameters and gradients."""
        params = list(self.model.parameters())
        offload = self.optimizer.offload
        optimizer = 0 if offload else sum(
            tensor_bytes(optimizer_state_tensors(part.optimizer.local)) for part in self.parts)
        shards = [] if offload else [part.grad_shard for part in self.parts]
        return ModelStateBytes(params=tensor_bytes(params),
                               grads=tensor_bytes([p.grad for p in params] + shards),
                               optimizer=optimizer)

    def host_state(self) -> ModelStateBytes:
        held = [part.optimizer.host_state() for part in self.parts]
        return ModelStateBytes(*(sum(getattr(h, k) for h in held)
                                 for k in ("params", "grads", "optimizer")))


class Zero1(ZeroDataParallel):
    """Full gradients accumulate in one flat buffer; only this rank's shard of it is summed."""

    name = "zero1"

    def setup_gradients(self) -> None:
        self.flat_grad = self.layout.empty(device=self.ctx.device)
        self.grad_shard = self.layout.shard(self.flat_grad, self.index)   # a view: no copy
        self.buckets = None
        if self.overlap:
            self.buckets = GradBuckets(self.layout, float(self.option("bucket_mb")) * MiB,
                                       reduce=self.bucket_reduce(), cut_at=self.bucket_cuts())
            self.buckets.attach(self.flat_grad)
        else:
            self.layout.bind_grads(self.flat_grad)

    def part_micro_step(self, is_last: bool):
        if self.buckets is None:
            return super().part_micro_step(is_last)
        return self.buckets.micro_step(is_last)

    def part_sync(self) -> None:
        if self.buckets is not None:
            # The buckets were reduced to their owners: this rank's shard of flat_grad holds the
            # sum. The rest is this rank's own gradient, which nothing reads.
            self.buckets.wait()
        elif injected(self.ctx.cfg, "zero1-unsynced"):
            pass    # the fault: grad_shard, a view of flat_grad, keeps this rank's own gradient
        else:
            # reduce_scatter_tensor's output may not alias its input: reduce, then copy in place.
            summed = torch.empty_like(self.grad_shard)
            self.reduce_scatter_into(summed, self.flat_grad)
            self.grad_shard.copy_(summed)

    def part_step(self) -> None:
        super().part_step()
        self.flat_grad.zero_()


class Zero2(ZeroDataParallel):
    """No full gradient buffer: buckets are reduced and freed while backward runs."""

    name = "zero2"

    def setup_gradients(self) -> None:
        # The only gradient memory that outlives a step: this rank's shard -- on the host under
        # offload (ZeRO-Offload streams the reduced gradients straight to the CPU optimizer).
        self.grad_shard = (self.optimizer.master.grad if self.optimizer.offload else
                           torch.zeros(self.layout.shard_numel, dtype=self.layout.dtype,
                                       device=self.ctx.device))
        self.stream = None
        if self.overlap:
            self.stream = StreamingReduce(self.layout, float(self.option("bucket_mb")) * MiB,
                                          self.bucket_cuts(), self.bucket_reduce(),
                                          self.grad_shard, self.index)

    def part_micro_step(self, is_last: bool):
        if self.stream is not None:
            self.stream.start()          # every micro-batch's gradients go out (and are freed)
        return super().part_micro_step(is_last)

    def part_sync(self) -> None:
        if self.stream is not None:
            self.stream.wait()
            return
        # Textbook order: autograd left full gradients; flatten, reduce-scatter, free them.
        params = self.layout.params
        flat_grad = self.layout.flatten([p.grad for p in params], device=self.ctx.device)
        for p in params:
            p.grad = None
        summed = torch.empty(self.layout.shard_numel, dtype=flat_grad.dtype, device=self.ctx.device)
        self.reduce_scatter_into(summed, flat_grad)
        self.grad_shard.copy_(summed)


class StreamingReduce:
    """ZeRO-2's gradient path: a bucket leaves the moment its gradients are complete, and the
    full-size gradients it was copied from are freed at once.

    Buckets are ranges of the flat layout in reverse parameter order, cut at shard boundaries
    (refimpl.parallel.dp.grad_buckets.assign_buckets), so each has one owner. When the last gradient
    feeding a bucket has been accumulated, the bucket is copied into a fresh buffer, reduced
    (async) to its owner, and every parameter whose buckets have all left drops its .grad. The
    owner adds the summed bucket into its gradient shard (on the host under offload) when the
    reduce completes; at most two buckets are in flight, so the buffers in flight stay bounded too.
    """

    def __init__(self, layout: FlatParams, cap_bytes: float, cuts: list[int], reduce,
                 grad_shard: torch.Tensor, index: int):
        self.layout, self.reduce, self.grad_shard = layout, reduce, grad_shard
        self.shard_start = index * layout.shard_numel
        self.buckets = assign_buckets(layout, cap_bytes, cut_at=cuts)
        self._feeds = [sum(i in b.params for b in self.buckets) for i in range(len(layout.slots))]
        self._in_flight: list = []
        self._next = 0
        this = weakref.ref(self)       # no reference cycle through the hooks (grad_buckets.py)
        self._handles = [p.register_post_accumulate_grad_hook(
            lambda _p, i=i: this()._on_gradient_ready(i)) for i, p in enumerate(layout.params)]

    def start(self) -> None:
        self._next = 0
        self._left = list(self._feeds)
        for b in self.buckets:
            b.pending = len(b.params)

    def _on_gradient_ready(self, i: int) -> None:
        for b in self.buckets:
            if i in b.params:
                b.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket) -> None:
        # On the gradients' device, not the shard's: under offload the shard is the host master's
        # gradient, and NCCL refuses a host tensor. The owner moves its summed bucket to the host
        # in _finish (issue 35).
        buf = torch.zeros(bucket.numel, dtype=self.grad_shard.dtype,   # zeros: the padding
                          device=self.layout.params[0].device)
        for i in bucket.params:
            slot, p = self.layout.slots[i], self.layout.params[i]
            lo, hi = max(bucket.start, slot.offset), min(bucket.end, slot.offset + slot.numel)
            buf[lo - bucket.start:hi - bucket.start] = \
                p.grad.reshape(-1)[lo - slot.offset:hi - slot.offset]
            self._left[i] -= 1
            if self._left[i] == 0:
                p.grad = None            # this parameter's full gradient is no longer needed
        while len(self._in_flight) >= 2:
            self._finish(*self._in_flight.pop(0))
        self._in_flight.append((bucket, buf, self.reduce(bucket, buf)))

    def _finish(self, bucket, buf: torch.Tensor, work) -> None:
        with comm_span("wait"):
            work.wait()
        start = bucket.start - self.shard_start
        if 0 <= start < self.grad_shard.numel():          # this rank owns the bucket
            self.grad_shard[start:start + bucket.numel] += buf.to(self.grad_shard.device)

    def wait(self) -> None:
        if self._next < len(self.buckets):
            raise RuntimeError(f"bucket {self._next} was never launched: a parameter got no "
                               "gradient (unused parameters are not supported)")
        while self._in_flight:
            self._finish(*self._in_flight.pop(0))
