"""ZeRO-2's gradient path (Rajbhandari et al. 2020, §5.2): bucket by bucket while backward runs,
each reduced to its owner and the full gradients it held freed."""
from __future__ import annotations

import weakref

import torch

from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import assign_buckets


class StreamingReduce:
    def __init__(self, layout: FlatParams, cap_bytes: float, cuts: list[int], reduce,
                 grad_shard: torch.Tensor, index: int):
        self.layout, self.reduce, self.grad_shard = layout, reduce, grad_shard
        self.shard_start = index * layout.shard_numel
        self.buckets = assign_buckets(layout, cap_bytes, cut_at=cuts)
        self._feeds = [sum(i in b.params for b in self.buckets) for i in range(len(layout.slots))]
        self._in_flight: list = []
        self._next = 0
        this = weakref.ref(self)       # no reference cycle through the hooks
        self._handles = [p.register_post_accumulate_grad_hook(
            lambda _p, i=i: this()._on_gradient_ready(i)) for i, p in enumerate(layout.params)]

    def start(self) -> None:
        """A backward begins: every bucket waits for all its gradients again."""
        self._next = 0
        self._left = list(self._feeds)
        for b in self.buckets:
            b.pending = len(b.params)

    def _on_gradient_ready(self, i: int) -> None:
        for b in self.buckets:
            if i in b.params:
                b.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])      # in bucket order on every rank
            self._next += 1

    def _launch(self, bucket) -> None:
        # on the gradients' device, not the shard's (the host under offload)
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
