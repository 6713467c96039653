"""`DataParallel`: PyTorch's DDP rebuilt, around any `nn.Module` (Li et al. 2020, §3.2).

    model = DataParallel(MyNet().to(device))      # rank 0's weights and buffers on every rank
    loss_fn(model(x_rank), y_rank).backward()     # buckets leave from hooks as backward runs
    model.finish_gradient_synchronization()       # every .grad: the mean over the ranks
"""
from __future__ import annotations

import contextlib

import torch.nn as nn

from refimpl.parallel.dp.grad_buckets import MiB, replicated_buckets
from refimpl.parallel.dp.wrapping import check_devices, claim, named_state, resolve_group
from refimpl.seam import dist


class DataParallel(nn.Module):
    """Replicates `module` over `group` (default: the world) and averages its gradients."""

    def __init__(self, module: nn.Module, *, group=None, bucket_mb: float = 25.0):
        super().__init__()
        if not bucket_mb > 0:
            raise ValueError(f"DataParallel: bucket_mb must be > 0, got {bucket_mb}")
        claim(module, "DataParallel")
        group = resolve_group(group, "DataParallel")
        check_devices(named_state(module), group, "DataParallel")
        self.module = module
        n = dist.get_world_size(group)
        if n > 1:
            for _, t in named_state(module):
                dist.broadcast(t.data, src=dist.get_global_rank(group, 0), group=group)
        sets: dict[tuple, list] = {}        # one flat gradient buffer per dtype and device
        for name, p in module.named_parameters():
            if p.requires_grad:
                sets.setdefault((p.dtype, p.device), []).append((name, p))
        self.bucket_sets = [replicated_buckets(named, group if n > 1 else None, bucket_mb * MiB,
                                               divisor=n) for named in sets.values()]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside only accumulate; the next one outside reduces the sum."""
        for buckets in self.bucket_sets:
            buckets.arm(sync=False)
        try:
            yield
        finally:
            for buckets in self.bucket_sets:
                buckets.arm(sync=True)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce (launching any not yet launched)."""
        for buckets in self.bucket_sets:
            buckets.finish_gradient_synchronization()
