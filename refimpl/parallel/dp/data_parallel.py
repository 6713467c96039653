"""`DataParallel`: the `dp` strategy's mechanism around any `nn.Module` (PyTorch's DDP, rebuilt).

    model = DataParallel(MyNet().to(device))          # rank 0's weights and buffers on every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model(x_rank), y_rank).backward()         # buckets leave from hooks as backward runs
    model.finish_gradient_synchronization()           # every .grad: the mean over the ranks
    opt.step(); opt.zero_grad()

What happens (Li et al. 2020, "PyTorch Distributed", §3.2; refimpl.parallel.dp.grad_buckets holds
the buckets and their hooks):

  * construction broadcasts rank 0's parameters and buffers over the group, so ranks that were
    seeded differently start equal (DDP's `_sync_module_states`);
  * the gradients of the parameters with requires_grad live in one flat buffer per dtype, cut into
    buckets of `bucket_mb` MiB in reverse parameter order; each .grad is a view into it;
  * a bucket is divided by the group's size and all-reduced (async) as soon as its last gradient
    has been accumulated; `finish_gradient_synchronization()` launches what a forward did not reach
    (an unused parameter: zero, so every rank issues the same collectives) and waits for all;
  * `no_sync()`: backwards inside only accumulate (gradient accumulation), the next one outside
    communicates the sum;
  * a frozen parameter (requires_grad=False) is broadcast once and never communicated again; a
    weight tied between two layers is one parameter with one gradient, reduced once.

Unlike DDP, the wait is explicit (DDP queues it at the end of backward on autograd's engine, a
private API): call `finish_gradient_synchronization()` after each synchronised backward.

The `dp` strategy is this class around the transformed GPT, with what the training loop needs
beyond the contract: `average=False` (the loop divides each rank's loss by W instead:
refimpl.strategy's docstring says why), `reduce_over` (a MoE's experts over their own ranks),
`broadcast=False` (every rank built the same model), `comm` (--collectives refimpl), and
`micro_step` (the runner's hook, with a pipeline's accumulation counts).
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch.distributed as dist
import torch.nn as nn

from refimpl.labels import comm_span
from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import GradBuckets, all_reduce_sum
from refimpl.parallel.dp.wrapping import check_devices, claim, group_size, named_state, resolve_group

MiB = 2 ** 20


class DataParallel(nn.Module):
    """Replicates `module` over `group` (default: the whole world) and averages its gradients.

    `.module` is the wrapped module; `forward` is its forward. See the module docstring."""

    def __init__(self, module: nn.Module, *, group=None, bucket_mb: float = 25.0,
                 average: bool = True, broadcast: bool = True,
                 reduce_over: Callable[[nn.Parameter], object] | None = None, comm=dist):
        super().__init__()
        who = "DataParallel"
        if not bucket_mb > 0:
            raise ValueError(f"{who}: bucket_mb must be > 0, got {bucket_mb}")
        claim(module, who)
        group = resolve_group(group, who)
        check_devices(named_state(module), group, who)
        self.module = module
        if broadcast:
            broadcast_from_first(named_state(module), group, comm)
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
            reduce = partial(all_reduce_sum, group=g if n > 1 else None, comm=comm,
                             divisor=n if average else 1)
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


def broadcast_from_first(named_tensors, group, comm=dist) -> None:
    """Every tensor overwritten with the first rank of `group`'s (in place)."""
    if group_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    for _, t in named_tensors:
        with comm_span("broadcast", t.nbytes):
            comm.broadcast(t.data, src=src, group=group)
