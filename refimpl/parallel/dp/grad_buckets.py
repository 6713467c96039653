"""Gradient buckets: communication that starts while backward is still running."""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.seam import dist

MiB = 2 ** 20


@dataclass
class Bucket:
    start: int                 # [start, end) in the flat gradient buffer
    end: int
    params: list[int]          # indices of the parameters with elements in [start, end)
    pending: int = 0           # gradients not yet accumulated in this backward
    work: object = field(default=None, repr=False)   # the collective's handle (None: none)

    @property
    def numel(self) -> int:
        return self.end - self.start


def assign_buckets(layout: FlatParams, cap_bytes: float, element_size: int = 4,
                   cut_at=()) -> list[Bucket]:
    """Cut the flat layout into buckets in reverse parameter order (the launch order: the last
    parameters' gradients are ready first); one closes at `cap_bytes`, and at each of `cut_at`."""
    edges, size = {layout.padded_numel}, 0
    for slot in reversed(layout.slots):
        size += slot.numel * element_size
        if size >= cap_bytes or slot is layout.slots[0]:
            edges.add(slot.offset)
            size = 0
    edges = sorted(edges | {c for c in cut_at if 0 < c < layout.padded_numel}, reverse=True)
    buckets = []
    for stop, start in zip(edges, edges[1:]):
        params = [i for i, s in enumerate(layout.slots)
                  if s.offset < stop and s.offset + s.numel > start]
        buckets.append(Bucket(start, stop, params))
    return buckets


def all_reduce_sum(bucket: Bucket, grads: torch.Tensor, *, group, divisor: int = 1):
    """The bucket summed on every rank of `group` (async; None: one rank, nothing to wait for),
    divided first by `divisor` (a mean)."""
    if divisor != 1:
        grads.div_(divisor)
    return None if group is None else dist.all_reduce(grads, group=group, async_op=True)


class GradBuckets:
    """One collective per bucket, launched from gradient hooks; `wait()` before the optimizer."""

    def __init__(self, layout: FlatParams, cap_bytes: float,
                 reduce: Callable[[Bucket, torch.Tensor], object], cut_at=()):
        self.layout = layout
        self.reduce = reduce
        self.buckets = assign_buckets(layout, cap_bytes, cut_at=cut_at)
        self._buckets_of = [[b for b in self.buckets if i in b.params]   # the buckets it feeds
                            for i in range(len(layout.slots))]
        self.flat_grad: torch.Tensor | None = None
        self._sync = False
        self._left: list[int] | None = None             # accumulations still to come (a pipeline)
        self._next = 0                                  # the next bucket to launch, in order
        self._ready = [False] * len(layout.slots)       # gradients in, this synchronised backward
        this = weakref.ref(self)      # hooks hold self weakly: no cycle through the parameters
        for i, p in enumerate(layout.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: this()._on_gradient_ready(i))
            # before autograd accumulates: a .grad zero_grad() set to None is bound to its view again
            p.register_hook(lambda _g, i=i: this()._rebind(i))

    def attach(self, flat_grad: torch.Tensor) -> None:
        """Point every parameter's .grad into `flat_grad`, where autograd will accumulate."""
        self.flat_grad = flat_grad
        self.layout.bind_grads(flat_grad)

    def _rebind(self, i: int) -> None:
        p = self.layout.params[i]
        if p.grad is None and self.flat_grad is not None:
            slot = self.layout.slots[i]
            view = self.flat_grad[slot.offset:slot.offset + slot.numel]
            p.grad = view.zero_().view(slot.shape)

    @contextlib.contextmanager
    def micro_step(self, sync: bool, accumulations: list[int] | None = None):
        """Around a micro-step's backward(s): sync=False only accumulates; `accumulations[i]`:
        gradients of parameter i inside (default one), ready at the last."""
        self.arm(sync, accumulations)
        yield

    def arm(self, sync: bool, accumulations: list[int] | None = None) -> None:
        """micro_step's work, for callers without a context."""
        self._sync = sync
        self._left = None if accumulations is None else list(accumulations)
        if sync:
            self._next = 0
            self._ready = [False] * len(self.layout.slots)
            for b in self.buckets:
                b.pending, b.work = len(b.params), None

    def _on_gradient_ready(self, i: int) -> None:
        if not self._sync:
            return
        if self._left is not None:
            self._left[i] -= 1
            if self._left[i]:
                return                                  # more backwards will add to it
        if self._ready[i]:
            raise RuntimeError(f"the gradient of {self.layout.slots[i].name} arrived twice in one "
                               "synchronised backward (finish the synchronisation after each)")
        self._ready[i] = True
        for b in self._buckets_of[i]:
            b.pending -= 1
        self._launch(lambda b: b.pending == 0)

    def _launch(self, ready) -> None:
        # in bucket order only: every rank issues the same collectives in the same order
        while self._next < len(self.buckets) and ready(self.buckets[self._next]):
            b = self.buckets[self._next]
            b.work = self._send(b)
            self._next += 1

    def _send(self, b: Bucket):
        return self.reduce(b, self.flat_grad[b.start:b.end])

    def finish_gradient_synchronization(self) -> None:
        """wait(), then armed for the next synchronised backward."""
        self.wait()
        self.arm(sync=True)

    def wait(self) -> None:
        """Block until every bucket's collective has completed (before the optimizer reads them)."""
        if self._sync:
            for i, p in enumerate(self.layout.params):
                if not self._ready[i]:
                    self._rebind(i)
            self._launch(lambda b: True)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        self._sync = False


def replicated_buckets(named: list, group, cap_bytes: float, divisor: int = 1) -> GradBuckets:
    """All-reduce buckets over `group` (None: one rank) for `named` parameters of one dtype, every
    .grad a view of one flat buffer, armed for a synchronised backward."""
    layout = FlatParams(named, world_size=1)      # replicated: not sharded, no padding
    buckets = GradBuckets(layout, cap_bytes, reduce=partial(all_reduce_sum, group=group,
                                                            divisor=divisor))
    buckets.attach(layout.empty(device=named[0][1].device))
    buckets.arm(sync=True)
    return buckets
