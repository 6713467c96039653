"""One unit of a fully sharded model: its parameters as flat shards, gathered only while needed.

ZeRO stage 3 (Rajbhandari et al. 2020, §5.3) and PyTorch FSDP (Zhao et al. 2023, §3) share one
mechanism, which this file holds; `zero3.py` decides *when* to call it (the policy).

A unit is a group of modules that compute together -- one transformer block, the embeddings, or
final_norm + lm_head. Its parameters are laid end to end in one `FlatParams` buffer, padded to a
multiple of the world size, and rank r keeps only shard r, in fp32: the *master* shard, the
parameter its optimizer updates. Around the unit's computation:

    gather()          all-gather the shards into `full`; the modules' parameters are views of it
    reshard()         free `full` (its storage is resized to 0: the memory really goes away)
    reduce_scatter()  lay the unit's gradients end to end in one flat buffer, sum it over
                      ranks, keep this rank's shard, free the buffer

Why free by resizing the storage rather than dropping the tensor? Autograd saved views of the
weights during forward (a Linear saves W for dX = dY·W). Those views keep pointing at the same
storage; filling it again before backward makes them valid again. FSDP does the same.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.labels import comm_span
from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.rank_values import RankValues


class ShardedUnit:
    """Flat shards of one unit's parameters on this rank, and the collectives that move them.

    `compute_dtype` is the dtype the parameters are gathered in (bf16 under mixed precision: half
    the all-gather bytes); the master shard and its gradient stay fp32. `master_device` is where
    the shard, its gradient and (through the optimizer) Adam's m and v live: the compute device, or
    the CPU under ZeRO-Offload (Ren et al. 2021), in which case the optimizer step runs there.
    """

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]], group, rank: int,
                 world_size: int, device: torch.device, compute_dtype: torch.dtype,
                 master_device: torch.device, comm=dist, average: bool = False,
                 values: RankValues | None = None):
        self.name = name
        # `group` is the dp x cp axis of the mesh; `rank`/`world_size` this rank's place in it.
        # `comm` is torch.distributed or refimpl.comm (--collectives refimpl): same signatures.
        self.group, self.rank, self.world_size, self.comm = group, rank, world_size, comm
        self.device, self.compute_dtype = device, compute_dtype
        self.average = average                 # divide the summed gradient by the world size
        self.flat = FlatParams(named_params, world_size)
        # The optimizer's parameter: the master dtype (the parameters' own: fp32, or float64
        # under --dtype float64), this rank's slice only. Its .grad is the grad shard.
        self.master = nn.Parameter(self._own_shard(values, master_device))
        self.master.grad = torch.zeros_like(self.master)
        # The gathered buffer, allocated once and then freed/refilled; parameters view into it
        # (`named_params` may be meta tensors, shapes only: they become views of it here).
        self.full = self.flat.empty(compute_dtype, device)
        self.flat.bind(self.full)
        self._free_storage(self.full)
        self.gathered = False
        self.pending_gather = None             # (work, send buffer) of an async all-gather
        self.grads_left = 0                    # countdown to "this unit's backward is done"
        self.delivered = 0                     # gradients in since its last reduce-scatter

    @torch.no_grad()
    def _own_shard(self, values: RankValues | None, device: torch.device) -> torch.Tensor:
        """This rank's slice [r·S, (r+1)·S) of the unit's flat parameters, made parameter by
        parameter: only the parameters reaching into it are read, from `values` (this rank's
        values, refimpl.rank_values) or, when None, from the parameters themselves. The unit is
        never whole here (issue 35: a rank builds only its own shard); the padding stays zero."""
        param = {slot.name: p for slot, p in zip(self.flat.slots, self.flat.params)}

        def read(slot):
            p = param[slot.name]
            return p.detach() if values is None else values.local(slot.name, p)
        return self.flat.filled_shard(read, self.rank, device=device)

    @property
    def numel(self) -> int:
        return self.flat.numel

    @property
    def gathered_bytes(self) -> int:
        """Bytes the gathered parameter buffer holds right now (0 when resharded)."""
        return self.full.untyped_storage().nbytes()

    # --- parameters -------------------------------------------------------------------------------

    def gather(self, async_op: bool = False) -> None:
        """All-gather every rank's shard into `full` (no-op if gathered or already on its way)."""
        if self.gathered or self.pending_gather is not None:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        # The shard as it travels: cast to the compute dtype, moved off the host under offload.
        send = self.master.detach().to(self.device, self.compute_dtype)
        # Written through `.data`, which has a version counter of its own: the backward's
        # regather puts back the very values the forward saved, and autograd, counting the
        # write on the parameters' views, would refuse them ("modified by an inplace operation").
        # Without this only saved-tensor hooks (the loop's ActivationTracker) hid the count.
        target = self.full.data
        if self.group is None:                 # one rank on the axis: the shard is everything
            target.copy_(send)
            self.gathered = True
            return
        with comm_span("all_gather", self.full.numel() * self.full.element_size()):
            work = self.comm.all_gather_into_tensor(target, send, group=self.group,
                                                    async_op=async_op)
        if async_op:
            self.pending_gather = (work, send)
        else:
            self.gathered = True

    def wait_gather(self) -> None:
        """Block until this unit's parameters are present, gathering now if nobody prefetched them."""
        if self.pending_gather is not None:
            work, _ = self.pending_gather
            with comm_span("wait"):
                work.wait()
            self.pending_gather = None
            self.gathered = True
        elif not self.gathered:
            self.gather()

    def reshard(self) -> None:
        """Free the gathered parameters; only this rank's master shard remains."""
        if self.pending_gather is not None:
            self.wait_gather()
        self._free_storage(self.full)
        self.gathered = False

    # --- gradients --------------------------------------------------------------------------------

    def expect_grads(self) -> None:
        """A backward through the unit is starting: its parameters' gradients will come, one
        each. Added, not set: under a split pipeline schedule (zb-h1) B of one micro-batch may
        start before the W of an earlier one has delivered its weight gradients (the runner's
        W, refimpl.parallel.pp.zero_bubble); each complete set of them is reduced (zero3.py)."""
        self.grads_left += len(self.flat.params)

    def flat_grads(self) -> torch.Tensor:
        """The unit's gradients laid end to end in one new buffer in the master dtype (what
        reduce-scatter sends; zero where a parameter got no gradient, and in the padding), each
        parameter's .grad dropped as soon as it is copied.

        Until this moment autograd keeps each gradient as its own tensor, as it computed it (a
        weight's gradient is the matmul's output, taken over without a copy), and FSDP2 does the
        same. A flat buffer bound as the .grads when the first gradient arrives would be the
        whole unit's size while only one of its gradients exists -- at the start of backward,
        the step's fullest moment (every activation still saved; under SHARD_GRAD_OP every unit
        gathered too): measured on the default GPT, block 3's 1.24 MB at that moment put
        `fsdp --set sharding=grad_op` above FSDP2's peak. Here the buffer exists only after the
        unit's backward, whose activations are freed by then. The values are the same: autograd
        sums a gradient that comes twice into the parameter's own .grad as it would into a view
        of the buffer, and a bf16 gradient widens to fp32 exactly."""
        flat = self.flat.empty(self.flat.dtype, self.device)
        for slot, p in zip(self.flat.slots, self.flat.params):
            if p.grad is not None:
                flat[slot.offset:slot.offset + slot.numel].copy_(p.grad.reshape(-1))
                p.grad = None
        return flat

    def reduce_scatter(self, async_op: bool = False):
        """Sum the flat gradient over ranks; this rank keeps its shard (ZeRO-2/3's reduce-scatter).

        Reduced in fp32 even under bf16 compute: a sum over many ranks in bf16 loses the low bits
        (FSDP's MixedPrecision reduce_dtype; torchtitan's default). Returns a `finish` callable
        that waits for the collective and adds the shard, averaged over ranks, to the master grad.
        """
        send = self.flat_grads()
        shard = torch.empty(self.flat.shard_numel, dtype=self.flat.dtype, device=self.device)
        if self.group is None:
            shard.copy_(send)
            async_op = False
        else:
            with comm_span("reduce_scatter", send.numel() * send.element_size()):
                work = self.comm.reduce_scatter_tensor(shard, send, op=dist.ReduceOp.SUM,
                                                       group=self.group, async_op=async_op)
        # Our reference to the full-size gradient ends here, also while an async reduce-scatter
        # is in flight: a backend that still reads it holds its own (NCCL stashes its inputs
        # with the work), and one that has copied it already (gloo reduces a clone) lets it go
        # now, instead of one unit's gradient staying alive through the next unit's backward.
        del send

        def finish() -> None:
            if async_op:
                with comm_span("wait"):
                    work.wait()
            # The training loop scaled each rank's loss by 1/ranks before backward, so the sum
            # over ranks is the global mean gradient (no per-element division, which is
            # inexact); a learner's loop did not (FullyShard's average=True): divide here.
            if self.average:
                shard.div_(self.world_size)
            if self.master.grad is None:       # zero_grad(set_to_none=True) since the last step
                self.master.grad = torch.zeros_like(self.master)
            self.master.grad.add_(shard.to(self.master.device))

        if not async_op:
            finish()
            return lambda: None
        return finish

    # --- gathering back -----------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Reference names -> full master-dtype tensors on the CPU. Collective: all ranks call it."""
        whole = self.flat.empty(device=self.device)
        if self.group is None:
            whole.copy_(self.master.detach())
        else:
            with comm_span("all_gather", whole.numel() * whole.element_size()):
                self.comm.all_gather_into_tensor(whole, self.master.detach().to(self.device),
                                                 group=self.group)
        return {k: v.cpu() for k, v in self.flat.state_dict(whole).items()}

    @staticmethod
    def _free_storage(t: torch.Tensor) -> None:
        t.untyped_storage().resize_(0)
