"""The communication of tensor parallelism: conjugate pairs of autograd Functions, and a counter.

Megatron-LM (Shoeybi et al. 2019, §3, Fig. 3) names two operators around a column-then-row pair:
`f` is the identity in forward and an all-reduce in backward, `g` is the reverse. The seed's
3.3 says the same in words: column parallelism needs an all-reduce of X's gradient in backward,
row parallelism an all-reduce of the partial outputs in forward. Each operator below is an
autograd Function whose backward is its partner's forward:

    copy_to_region        (f)  fwd identity            bwd all-reduce        before a column-parallel layer
    reduce_from_region    (g)  fwd all-reduce          bwd identity          after a row-parallel layer
    split_last_dim             fwd keep my slice       bwd all-gather        (row layer fed a full input)
    gather_last_dim            fwd all-gather          bwd keep my slice     (column layer, gather_output)
  sequence parallelism (Korthikanti et al. 2022, §4.2.2: f and g become an all-gather and a
  reduce-scatter along the sequence, so LayerNorm and dropout run on 1/t of the tokens):
    gather_from_sequence       fwd all-gather along s  bwd reduce-scatter    before a column-parallel layer
    scatter_to_sequence        fwd reduce-scatter      bwd all-gather        after a row-parallel layer
    split_sequence             fwd keep my s-slice     bwd all-gather        (enter the SP region)
    gather_sequence            fwd all-gather along s  bwd keep my s-slice   (a replicated region
                                                                              inside SP: the MoE router)

Our activations are [batch, seq, hidden] (Megatron's are [seq, batch, hidden]), so the sequence is
dim 1; a collective needs contiguous chunks, so we move it to the front for the call and back.

Each helper returns its input untouched when the group has one rank (group None means "no TP").
`comm` is the collectives module (torch.distributed, or refimpl.comm under --collectives refimpl:
the same signatures), passed down from the layer that owns the group.
Every call is labelled `comm:<op> <bytes>B` for the profiler and recorded, with its pass (forward
or backward), in the open `CommLog`s (refimpl.labels). The logs an op writes to in backward
are the ones open when its forward ran: backward may run on another thread (autograd's device
threads on GPU).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.labels import comm_span, open_logs


def group_size(group) -> int:
    """Ranks in a TP group; None is one rank (no TP), never the default group."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# --- the collectives, labelled and logged ----------------------------------------------------------

def _all_reduce(x: torch.Tensor, group, comm, logs, pass_: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous().clone()        # never reduce into a tensor autograd still holds
    name = "all_reduce" if op == dist.ReduceOp.SUM else "all_reduce_max"
    with comm_span(name, x.nbytes, world=group_size(group), pass_=pass_, logs=logs):
        comm.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group, comm, logs, pass_: str) -> torch.Tensor:
    t = group_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((t * front.shape[0],) + front.shape[1:], dtype=x.dtype, device=x.device)
    with comm_span("all_gather", out.nbytes, world=t, pass_=pass_, logs=logs):
        comm.all_gather_into_tensor(out, front, group=group)
    # Contiguous in the caller's layout: a matmul on a strided input copies it, and Q, K and V
    # would each save their own copy of the gathered tokens.
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group, comm, logs, pass_: str) -> torch.Tensor:
    t = group_size(group)
    front = x.movedim(dim, 0).contiguous()
    if front.shape[0] % t:
        raise ValueError(f"reduce-scatter: dim {dim} of size {front.shape[0]} does not divide by {t}")
    out = torch.empty((front.shape[0] // t,) + front.shape[1:], dtype=x.dtype, device=x.device)
    with comm_span("reduce_scatter", front.nbytes, world=t, pass_=pass_, logs=logs):
        comm.reduce_scatter_tensor(out, front, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim).contiguous()


def _my_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    t, r = group_size(group), group_rank(group)
    if x.shape[dim] % t:
        raise ValueError(f"split: dim {dim} of size {x.shape[dim]} does not divide by {t}")
    return x.chunk(t, dim=dim)[r].contiguous()


# --- the conjugate pairs ---------------------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group, ctx.comm, ctx.logs = group, comm, open_logs()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.comm, ctx.logs, "backward"), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        return _all_reduce(x, group, comm, open_logs(), "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _SplitLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group, ctx.comm, ctx.logs = group, comm, open_logs()
        return _my_slice(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.group, ctx.comm, ctx.logs, "backward"), None, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group = group
        return _all_gather(x, -1, group, comm, open_logs(), "forward")

    @staticmethod
    def backward(ctx, grad):
        return _my_slice(grad, -1, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group, ctx.comm, ctx.logs = group, comm, open_logs()
        return _all_gather(x, 1, group, comm, ctx.logs, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group, ctx.comm, ctx.logs, "backward"), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group, ctx.comm, ctx.logs = group, comm, open_logs()
        return _reduce_scatter(x, 1, group, comm, ctx.logs, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group, ctx.comm, ctx.logs, "backward"), None, None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group, ctx.comm, ctx.logs = group, comm, open_logs()
        return _my_slice(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group, ctx.comm, ctx.logs, "backward"), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group = group
        return _all_gather(x, 1, group, comm, open_logs(), "forward")

    @staticmethod
    def backward(ctx, grad):
        return _my_slice(grad, 1, ctx.group), None, None


def _one_rank_or(fn):
    def apply(x: torch.Tensor, group, comm=dist) -> torch.Tensor:
        return x if group_size(group) == 1 else fn.apply(x, group, comm)
    apply.__doc__ = fn.__name__.strip("_")
    return apply


copy_to_region = _one_rank_or(_CopyToRegion)
reduce_from_region = _one_rank_or(_ReduceFromRegion)
split_last_dim = _one_rank_or(_SplitLastDim)
gather_last_dim = _one_rank_or(_GatherLastDim)
gather_from_sequence = _one_rank_or(_GatherFromSequence)
scatter_to_sequence = _one_rank_or(_ScatterToSequence)
split_sequence = _one_rank_or(_SplitSequence)
gather_sequence = _one_rank_or(_GatherSequence)


# A replicated parameter applied to sequence-split tokens (LayerNorm, row-parallel bias, positions)
# gets a gradient partial over the sequence on each rank; tp.parallelize sums it over tp in backward.
SEQUENCE_PARTIAL = "_refimpl_sequence_partial"


def mark_sequence_partial(p: torch.Tensor) -> None:
    setattr(p, SEQUENCE_PARTIAL, True)


def is_sequence_partial(p: torch.Tensor) -> bool:
    return getattr(p, SEQUENCE_PARTIAL, False)


def all_reduce_logged(x: torch.Tensor, group, op=dist.ReduceOp.SUM, comm=dist) -> torch.Tensor:
    """A plain (non-autograd) all-reduce of a copy of x, labelled and logged as a forward call:
    the vocabulary-parallel cross-entropy's max and sum-exp reductions use it."""
    if group_size(group) == 1:
        return x
    return _all_reduce(x, group, comm, open_logs(), "forward", op=op)


def all_reduce_grad_logged(grad: torch.Tensor, group, comm=dist) -> torch.Tensor:
    """Sum a gradient over the group inside backward (sequence-parallel LayerNorm weights)."""
    if group_size(group) == 1:
        return grad
    return _all_reduce(grad, group, comm, open_logs(), "backward")
