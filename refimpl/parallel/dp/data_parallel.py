"""`DataParallel`: PyTorch's DDP rebuilt, around any `nn.Module` (Li et al. 2020, §3.2).

    model = DataParallel(MyNet().to(device))      # rank 0's weights and buffers on every rank
    loss_fn(model(x_rank), y_rank).backward()     # buckets leave from hooks as backward runs
    model.finish_gradient_synchronization()       # every .grad: the mean over the ranks
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch.nn as nn

from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import GradBuckets, all_reduce_sum
from refimpl.parallel.dp.wrapping import check_devices, claim, named_state, resolve_group
from refimpl.seam import dist

MiB = 2 ** 20


class DataParallel(nn.Module):
    """Replicates `module` over `group` (default: the world) and averages its gradients.
    `reduce_over(p)`: the group p's gradient is summed over instead (None: one rank holds it)."""

    def __init__(self, module: nn.Module, *, group=None, bucket_mb: float = 25.0,
                 average: bool = True, broadcast: bool = True,
                 reduce_over: Callable[[nn.Parameter], object] | None = None):
        super().__init__()
        if not bucket_mb > 0:
            raise ValueError(f"DataParallel: bucket_mb must be > 0, got {bucket_mb}")
        claim(module, "DataParallel")
        group = resolve_group(group, "DataParallel")
        check_devices(named_state(module), group, "DataParallel")
        self.module = module
        if broadcast and dist.get_world_size(group) > 1:
            for _, t in named_state(module):
                dist.broadcast(t.data, src=dist.get_global_rank(group, 0), group=group)
        sets: dict[tuple, list] = {}        # one flat gradient buffer per (group, dtype, device)
        for name, p in module.named_parameters():
            if p.requires_grad:
                g = reduce_over(p) if reduce_over is not None else group
                sets.setdefault((id(g), p.dtype, p.device), (g, []))[1].append((name, p))
        self.bucket_sets = [self._buckets(g, named, bucket_mb * MiB, average)
                            for g, named in sets.values()]

    @staticmethod
    def _buckets(group, named: list, cap_bytes: float, average: bool) -> GradBuckets:
        n = 1 if group is None else dist.get_world_size(group)
        layout = FlatParams(named, world_size=1)      # replicated: not sharded, no padding
        reduce = partial(all_reduce_sum, group=group if n > 1 else None,
                         divisor=n if average else 1)
        buckets = GradBuckets(layout, cap_bytes, reduce=reduce)
        buckets.attach(layout.empty(device=named[0][1].device))
        buckets.arm(sync=True)
        return buckets

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def micro_step(self, sync: bool = True, accumulations: dict[str, int] | None = None):
        """The backward(s) inside communicate (sync) or only accumulate; `accumulations[name]`:
        how many gradients of that parameter come inside (a pipeline's step; default one)."""
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
        """Backwards inside only accumulate; the next one outside reduces the sum."""
        return self.micro_step(sync=False)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce (launching any not yet launched)."""
        for buckets in self.bucket_sets:
            buckets.wait()
            buckets.arm(sync=True)
