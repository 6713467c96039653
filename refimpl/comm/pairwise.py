"""All-to-all by pairwise exchange: in step s, rank r sends to r+s and receives from r-s."""
from __future__ import annotations

import torch

from refimpl.comm.p2p import GroupView, exchange, nbytes
from refimpl.comm.work import issue


def pairwise_all_to_all_(outputs: list[torch.Tensor], inputs: list[torch.Tensor], g: GroupView) -> None:
    n, r = g.size, g.rank
    outputs[r].copy_(inputs[r])
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        exchange(g, sends=[(inputs[to], to)], recvs=[(outputs[frm], frm)])


def _split(tensor: torch.Tensor, sizes, n: int) -> list[torch.Tensor]:
    if sizes is None:
        if tensor.shape[0] % n:
            raise ValueError(f"dim 0 ({tensor.shape[0]}) must divide by the group size ({n}) "
                             "when no split sizes are given")
        sizes = [tensor.shape[0] // n] * n
    return list(tensor.split(list(sizes), dim=0))


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    """torch.distributed.all_to_all_single: input rows are cut into n pieces (even, or by
    `input_split_sizes`); piece i goes to rank i, and what rank i sent lands in output piece i."""

    def body(g: GroupView):
        pairwise_all_to_all_(_split(output, output_split_sizes, g.size),
                             _split(input, input_split_sizes, g.size), g)

    return issue("all_to_all", group, async_op, body, nbytes(input))


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """torch.distributed.all_to_all: output_tensor_list[i] <- rank i's input_tensor_list[rank]."""

    def body(g: GroupView):
        pairwise_all_to_all_(list(output_tensor_list), list(input_tensor_list), g)

    return issue("all_to_all", group, async_op, body, sum(nbytes(t) for t in input_tensor_list))
