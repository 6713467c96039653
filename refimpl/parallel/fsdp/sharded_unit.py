"""One unit of a fully sharded model (ZeRO-3 §5.3; FSDP §3): its parameters in one flat buffer,
rank r keeping shard r (the `master` its optimizer steps). gather() all-gathers them into `full`,
reshard() frees `full`'s storage, reduce_scatter() sums the gradient into this rank's shard."""
from __future__ import annotations

import torch
import torch.nn as nn

from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.seam import dist


class ShardedUnit:
    """`group` None: this rank alone. Gathered in `compute_dtype`; the master shard and its
    gradient keep the parameters' dtype, on `master_device`. `average`: divide the sum by N."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], group,
                 device: torch.device, compute_dtype: torch.dtype, master_device: torch.device,
                 average: bool = False):
        self.name, self.group, self.average = name, group, average
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.device, self.compute_dtype = device, compute_dtype
        self.flat = FlatParams(named_params, self.world_size)
        named = dict(named_params)        # the master shard: [r·S, (r+1)·S) of the flat parameters
        self.master = nn.Parameter(self.flat.filled_shard(lambda s: named[s.name].detach(),
                                                          self.rank, device=master_device))
        self.master.grad = torch.zeros_like(self.master)
        # allocated once, then freed and refilled; the parameters become views of it (never
        # zeroed here: the host's heap would keep every unit's pages)
        self.full = torch.empty(self.flat.padded_numel, dtype=compute_dtype, device=device)
        self.flat.bind(self.full)
        self.full.untyped_storage().resize_(0)
        self.gathered = False
        self.pending_gather = None             # (work, send buffer) of an async all-gather
        self.grads_left = 0                    # gradients still expected from running backwards
        self.delivered = 0                     # gradients in since its last reduce-scatter

    def gather(self, async_op: bool = False) -> None:
        """All-gather every rank's shard into `full` (no-op if gathered or already on its way)."""
        if self.gathered or self.pending_gather is not None:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        send = self.master.detach().to(self.device, self.compute_dtype)   # off the host, cast
        # through `.data`: the regather must not bump the version counter autograd checks
        target = self.full.data
        if self.group is None:
            target.copy_(send)
            self.gathered = True
            return
        work = dist.all_gather_into_tensor(target, send, group=self.group, async_op=async_op)
        if async_op:
            self.pending_gather = (work, send)
        else:
            self.gathered = True

    def wait_gather(self) -> None:
        """Block until the parameters are present, gathering now if nobody prefetched them."""
        if self.pending_gather is not None:
            self.pending_gather[0].wait()
            self.pending_gather = None
            self.gathered = True
        elif not self.gathered:
            self.gather()

    def reshard(self) -> None:
        """Free the gathered parameters; only this rank's master shard remains."""
        if self.pending_gather is not None:
            self.wait_gather()
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def reduce_scatter(self, async_op: bool = False):
        """Sum the flat gradient over ranks in the master dtype; `finish` (returned) waits and
        adds this rank's shard into the master's grad."""
        send = self.flat.take_grads(device=self.device)   # in the master dtype
        shard = torch.empty(self.flat.shard_numel, dtype=self.flat.dtype, device=self.device)
        if self.group is None:
            shard.copy_(send)
            async_op = False
        else:
            work = dist.reduce_scatter_tensor(shard, send, group=self.group, async_op=async_op)
        del send   # a backend still reading it holds its own reference

        def finish() -> None:
            if async_op:
                work.wait()
            if self.average:                   # a learner's loop did not divide the loss
                shard.div_(self.world_size)
            if self.master.grad is None:       # zero_grad(set_to_none=True) since the last step
                self.master.grad = torch.zeros_like(self.master)
            self.master.grad.add_(shard.to(self.master.device))

        if not async_op:
            finish()
            return lambda: None
        return finish

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Reference names -> whole master-dtype tensors on the CPU (collective)."""
        whole = self.flat.empty(device=self.device)
        if self.group is None:
            whole.copy_(self.master.detach())
        else:
            dist.all_gather_into_tensor(whole, self.master.detach().to(self.device),
                                        group=self.group)
        return {k: v.cpu() for k, v in self.flat.state_dict(whole).items()}
