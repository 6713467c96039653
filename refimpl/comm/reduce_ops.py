"""The reduction a collective applies when two partial results meet: `acc = op(acc, incoming)`;
AVG is SUM, divided once at the end (as NCCL's ncclAvg)."""
from __future__ import annotations

import torch
from torch.distributed import ReduceOp

_IN_PLACE = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVG: torch.Tensor.add_,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    ReduceOp.BAND: torch.Tensor.bitwise_and_,
    ReduceOp.BOR: torch.Tensor.bitwise_or_,
    ReduceOp.BXOR: torch.Tensor.bitwise_xor_,
}


def _key(op):
    # torch hands out both `ReduceOp.SUM` (a RedOpType) and `ReduceOp(ReduceOp.SUM)` instances.
    return op.op if hasattr(op, "op") and not isinstance(op, ReduceOp.RedOpType) else op


def check_op(op) -> None:
    if _key(op) not in _IN_PLACE:
        raise ValueError(f"refimpl.comm does not implement reduce op {op}")


def reduce_into(acc: torch.Tensor, incoming: torch.Tensor, op) -> torch.Tensor:
    """acc <- op(acc, incoming), in place (no new tensor per step of a ring)."""
    _IN_PLACE[_key(op)](acc, incoming)
    return acc


def finish(acc: torch.Tensor, op, group_size: int) -> torch.Tensor:
    """The last step of AVG: the sum of `group_size` contributions divided by `group_size`."""
    if _key(op) == ReduceOp.AVG:
        if not acc.is_floating_point():
            raise TypeError("ReduceOp.AVG needs a floating-point tensor")
        acc.div_(group_size)
    return acc
