"""`DataParallel`: the `dp` strategy's mechanism around any `nn.Module` (PyTorch's DDP, rebuilt).

    model = DataParallel(MyNet().to(device))          # rank 0's weights and buffers on every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model(x_rank), y_rank).backward()         # buckets leave from hooks as backward runs
    model.finish_gradient_synchronization()           # every .grad: the mean over the ranks
    opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch.nn as nn

from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import GradBuckets, all_reduce_sum
from refimpl.parallel.dp.wrapping import check_devices, claim, group_size, named_state, resolve_group
from refimpl.seam import dist

MiB = 2 ** 20


class DataParallel(nn.Module):
    """Replicates `module` over `group` (default: the whole world) and averages its gradients."""

    def __init__(self, module: nn.Module, *, group=None, bucket_mb: float = 25.0,
                 average: bool = True, broadcast: bool = True,
                 reduce_over: Callable[[nn.Parameter], object] | None = None):
        super().__init__()
        who = "DataParallel"
        if not bucket_mb > 0:
            raise ValueError(f"{who}: bucket_mb must be > 0, got {bucket_mb}")
        claim(module, who)
        group = resolve_group(group, who)
        check_devices(named_state(module), group, who)
        self.module = module
        if broadcast:
            broadcast_from_first(named_state(module), group)
        # One flat gradient buffer (and its buckets) per (group, dtype) the gradients are summed
        # over; `reduce_over(p)` -> a group, or None where one rank holds the parameter.
        sets: dict[tuple, list] = {}
        for name, p in module.named_parameters():
            if p.requires_grad:
                g = reduce_over(p) if reduce_over is not None else group
                sets.setdefault((id(g), p.dtype, p.device), (g, []))[1].append((name, p))
        self.bucket_sets: list[GradBuckets] = []
        for g, named in sets.values():
            n = 1 if g is None else group_size(g)
            layout = FlatParams(named, world_size=1)      # replicated: not sharded, no padding
            reduce = partial(all_reduce_sum, group=g if n > 1 else None, divisor=n if average else 1)
            buckets = GradBuckets(layout, float(bucket_mb) * MiB, reduce=reduce)
            buckets.attach(layout.empty(device=named[0][1].device))
            buckets.arm(sync=True)
            self.bucket_sets.append(buckets)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def micro_step(self, sync: bool = True, accumulations: dict[str, int] | None = None):
        """The backward(s) inside communicate (sync) or only accumulate. `accumulations[name]`:
        how many times that parameter's gradient is accumulated inside (a pipeline's step runs
        many backwards; default once): its bucket counts it ready at the last."""
        for buckets in self.bucket_sets:
            counts = (None if accumulations is None else
                      [accumulations[slot.name] for slot in buckets.layout.slots])
            buckets.arm(sync, counts)
        try:
            yield
        finally:
            if not sync:
                for buckets in self.bucket_sets:
                    buckets.arm(sync=True)

    def no_sync(self):
        """Backwards inside accumulate their gradients locally; the next one outside reduces the sum."""
        return self.micro_step(sync=False)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce (launching those a forward did not reach): each
        .grad then holds the gradient averaged over the group. Ready for the next backward."""
        for buckets in self.bucket_sets:
            buckets.wait()
            buckets.arm(sync=True)


def broadcast_from_first(named_tensors, group) -> None:
    """Every tensor overwritten with the first rank of `group`'s (in place)."""
    if group_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    for _, t in named_tensors:
        dist.broadcast(t.data, src=src, group=group)
