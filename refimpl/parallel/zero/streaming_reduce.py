"""ZeRO-2's gradient path (Rajbhandari et al. 2020, §5.2): bucket by bucket while backward runs,
each reduced to its owner and the full gradients it held freed."""
from __future__ import annotations

import torch

from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import Bucket, GradBuckets


class StreamingReduce(GradBuckets):
    """GradBuckets without a flat gradient buffer: a bucket is copied out of autograd's gradients
    when ready, reduced to its owner (at most two in flight), added into its `grad_shard`."""

    def __init__(self, layout: FlatParams, cap_bytes: float, cuts: list[int], reduce,
                 grad_shard: torch.Tensor, index: int):
        super().__init__(layout, cap_bytes, reduce, cut_at=cuts)
        self.grad_shard = grad_shard
        self.shard_start = index * layout.shard_numel
        self._in_flight: list = []

    def arm(self, sync: bool = True, accumulations: list[int] | None = None) -> None:
        super().arm(sync, accumulations)
        self._unsent = [len(feeds) for feeds in self._buckets_of]   # buckets each still feeds

    def _send(self, bucket: Bucket) -> None:
        # on the gradients' device, not the shard's (the host under offload)
        buf = torch.zeros(bucket.numel, dtype=self.grad_shard.dtype,   # zeros: the padding
                          device=self.layout.params[0].device)
        for i in bucket.params:
            slot, p = self.layout.slots[i], self.layout.params[i]
            lo, hi = max(bucket.start, slot.offset), min(bucket.end, slot.offset + slot.numel)
            buf[lo - bucket.start:hi - bucket.start] = \
                p.grad.reshape(-1)[lo - slot.offset:hi - slot.offset]
            self._unsent[i] -= 1
            if self._unsent[i] == 0:
                p.grad = None            # this parameter's full gradient is no longer needed
        while len(self._in_flight) >= 2:
            self._finish(*self._in_flight.pop(0))
        self._in_flight.append((bucket, buf, self.reduce(bucket, buf)))

    def _finish(self, bucket: Bucket, buf: torch.Tensor, work) -> None:
        if work is not None:
            work.wait()
        start = bucket.start - self.shard_start
        if 0 <= start < self.grad_shard.numel():          # this rank owns the bucket
            self.grad_shard[start:start + bucket.numel] += buf.to(self.grad_shard.device)

    def wait(self) -> None:
        """Every bucket of this backward reduced and added into its owner's shard."""
        if self._next < len(self.buckets):
            raise RuntimeError(f"bucket {self._next} was never launched: a parameter got no "
                               "gradient (unused parameters are not supported)")
        while self._in_flight:
            self._finish(*self._in_flight.pop(0))
