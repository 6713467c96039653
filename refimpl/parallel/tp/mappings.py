"""Tensor parallelism's communication: conjugate pairs of autograd Functions, each one's backward
being its partner op (Megatron-LM, Shoeybi et al. 2019, §3, Fig. 3; seed §3.3), and sequence
parallelism's pair along s, dim 1 of our [b, s, h] (Korthikanti et al. 2022, §4.2.2)."""
from __future__ import annotations

import torch
from torch.autograd import Function
from torch.distributed import ReduceOp, get_rank, get_world_size

from refimpl.seam import dist


def group_size(group) -> int:
    """Ranks in a TP group; None is one rank (no TP), never the default group."""
    return 1 if group is None else get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else get_rank(group)


# --- the collectives ------------------------------------------------------------------------

def all_reduce(x: torch.Tensor, group, op=ReduceOp.SUM) -> torch.Tensor:
    """A reduced copy of x (never reduce into a tensor autograd still holds); x on one rank."""
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    front = x.movedim(dim, 0).contiguous()     # a collective needs contiguous chunks
    out = front.new_empty((group_size(group) * front.shape[0],) + front.shape[1:])
    dist.all_gather_into_tensor(out, front, group=group)
    # contiguous in the caller's layout: Q, K and V would each copy a strided input
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    t, front = group_size(group), x.movedim(dim, 0).contiguous()
    if front.shape[0] % t:
        raise ValueError(f"reduce-scatter: dim {dim} of size {front.shape[0]} does not divide by {t}")
    out = front.new_empty((front.shape[0] // t,) + front.shape[1:])
    dist.reduce_scatter_tensor(out, front, op=ReduceOp.SUM, group=group)
    return out.movedim(0, dim).contiguous()


def my_slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    t = group_size(group)
    if x.shape[dim] % t:
        raise ValueError(f"split: dim {dim} of size {x.shape[dim]} does not divide by {t}")
    return x.chunk(t, dim=dim)[group_rank(group)].contiguous()


# --- the conjugate pairs: each backward is the partner op ------------------------------------

class _CopyToRegion(Function):                       # f
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_from_region(grad, ctx.group), None


class _ReduceFromRegion(Function):                   # g
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return copy_to_region(grad, ctx.group), None


class _Pair(Function):
    """The split/gather pairs along `dim`: `forward` forward, its partner `backward` on dY."""

    @staticmethod
    def forward(ctx, x, group, dim, forward, backward):
        ctx.group, ctx.dim, ctx.partner = group, dim, backward
        return forward(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.partner(grad, ctx.group, ctx.dim), None, None, None, None


def _op(function, *args):
    """The op as callers see it: `op(x, group)`; one rank (group None) returns x untouched."""
    def apply(x: torch.Tensor, group) -> torch.Tensor:
        return x if group_size(group) == 1 else function.apply(x, group, *args)
    return apply


copy_to_region = _op(_CopyToRegion)                                       # f
reduce_from_region = _op(_ReduceFromRegion)                               # g
split_last_dim = _op(_Pair, -1, my_slice, all_gather)
gather_last_dim = _op(_Pair, -1, all_gather, my_slice)
split_sequence = _op(_Pair, 1, my_slice, all_gather)
gather_sequence = _op(_Pair, 1, all_gather, my_slice)
gather_from_sequence = _op(_Pair, 1, all_gather, reduce_scatter)          # SP's entry
scatter_to_sequence = _op(_Pair, 1, reduce_scatter, all_gather)           # SP's exit


def enter_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Before column-parallel layers: f, or under SP the all-gather of the sequence."""
    return gather_from_sequence(x, group) if sequence_parallel else copy_to_region(x, group)


def exit_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """After a row-parallel layer: g, or under SP the reduce-scatter of the sequence."""
    return scatter_to_sequence(x, group) if sequence_parallel else reduce_from_region(x, group)
