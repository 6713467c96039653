"""One unit of a fully sharded model (ZeRO-3, Rajbhandari et al. 2020 §5.3; FSDP, Zhao et al. 2023
§3): its parameters laid end to end in one flat buffer (refimpl.parallel.dp.flat_param), of which
rank r keeps shard r, the *master* its optimizer steps.

    gather()          all-gather the shards into `full`; the modules' parameters are views of it
    reshard()         free `full` by resizing its storage to 0: the views autograd saved in
                      forward stay valid and see the values again once it is refilled (as FSDP)
    reduce_scatter()  the unit's gradients laid flat, summed over ranks; this rank keeps its shard
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.seam import dist


class ShardedUnit:
    """`group`: the ranks sharing the unit (None: this rank alone holds it). `compute_dtype`: the
    dtype it is gathered and used in (bf16 halves the all-gather); the master shard and its gradient
    keep the parameters' dtype, on `master_device` (the host under ZeRO-Offload). `average`:
    divide the summed gradient by the group's size (False where each rank's loss was divided)."""

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], group,
                 device: torch.device, compute_dtype: torch.dtype, master_device: torch.device,
                 average: bool = False):
        self.name, self.group, self.average = name, group, average
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.device, self.compute_dtype = device, compute_dtype
        self.flat = FlatParams(named_params, self.world_size)
        self.master = nn.Parameter(self._own_shard(master_device))
        self.master.grad = torch.zeros_like(self.master)
        # The gathered buffer, allocated once, then freed and refilled; the parameters (perhaps
        # meta tensors until now: shapes only) become views of it. Never filled here: zeroing it
        # wrote every unit's pages once, and the host's heap kept them (issue 52: a whole model).
        self.full = torch.empty(self.flat.padded_numel, dtype=compute_dtype, device=device)
        self.flat.bind(self.full)
        self.full.untyped_storage().resize_(0)
        self.gathered = False
        self.pending_gather = None             # (work, send buffer) of an async all-gather
        self.grads_left = 0                    # gradients still expected from running backwards
        self.delivered = 0                     # gradients in since its last reduce-scatter

    def _own_shard(self, device: torch.device) -> torch.Tensor:
        """[r·S, (r+1)·S) of the flat parameters, read from the parameters reaching into it; zero
        where they are shapes (meta: `load` gives the values)."""
        if any(p.is_meta for p in self.flat.params):
            return torch.zeros(self.flat.shard_numel, dtype=self.flat.dtype, device=device)
        param = {s.name: p for s, p in zip(self.flat.slots, self.flat.params)}
        return self.flat.filled_shard(lambda s: param[s.name].detach(), self.rank, device=device)

    @torch.no_grad()
    def load(self, values: Mapping[str, torch.Tensor]) -> None:
        """The master shard from `values` (name -> that parameter's value): only the parameters
        reaching into the shard are read, one at a time (a rank builds only its own shard)."""
        self.flat.filled_shard(lambda s: values[s.name], self.rank, out=self.master.data)

    @property
    def numel(self) -> int:
        return self.flat.numel

    @property
    def gathered_bytes(self) -> int:
        """Bytes the gathered parameter buffer holds right now (0 when resharded)."""
        return self.full.untyped_storage().nbytes()

    def gather(self, async_op: bool = False) -> None:
        """All-gather every rank's shard into `full` (no-op if gathered or already on its way)."""
        if self.gathered or self.pending_gather is not None:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        send = self.master.detach().to(self.device, self.compute_dtype)   # off the host, cast
        # Written through `.data`, whose version counter is its own: the backward's regather puts
        # back the values forward saved, which autograd would refuse as an in-place change.
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

    def expect_grads(self) -> None:
        """A backward through the unit starts: one gradient per parameter will come. Added, not
        set: under a split pipeline schedule (zb-h1) a B may start before an earlier W delivered."""
        self.grads_left += len(self.flat.params)

    def flat_grads(self) -> torch.Tensor:
        """The unit's gradients laid end to end in a new buffer of the master dtype (zero where a
        parameter got none, and in the padding), each .grad dropped once copied. Made only now,
        after the unit's backward, not bound as the .grads while its activations are alive."""
        flat = self.flat.empty(self.flat.dtype, self.device)
        for slot, p in zip(self.flat.slots, self.flat.params):
            if p.grad is not None:
                flat[slot.offset:slot.offset + slot.numel].copy_(p.grad.reshape(-1))
                p.grad = None
        return flat

    def reduce_scatter(self, async_op: bool = False):
        """Sum the flat gradient over ranks, in the master dtype (bf16 sums would lose the low
        bits); returns `finish`, which waits and adds this rank's shard into the master's grad."""
        send = self.flat_grads()
        shard = torch.empty(self.flat.shard_numel, dtype=self.flat.dtype, device=self.device)
        if self.group is None:
            shard.copy_(send)
            async_op = False
        else:
            work = dist.reduce_scatter_tensor(shard, send, group=self.group, async_op=async_op)
        del send   # a backend still reading it holds its own reference (NCCL stashes its inputs)

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
        """Reference names -> full master-dtype tensors on the CPU. Collective: all ranks call it."""
        whole = self.flat.empty(device=self.device)
        if self.group is None:
            whole.copy_(self.master.detach())
        else:
            dist.all_gather_into_tensor(whole, self.master.detach().to(self.device),
                                        group=self.group)
        return {k: v.cpu() for k, v in self.flat.state_dict(whole).items()}
