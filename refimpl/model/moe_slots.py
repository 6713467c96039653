"""Fixed-size expert buffers: how the MoE layer moves its tokens without reading a count on the host.

Why. Under a capacity, an expert takes at most C assignments per forward, and C comes from the
batch's shape alone (refimpl.model.moe: C = ceil(k * T / E * capacity_factor)). So every buffer
can have a size known before the step starts, as in GShard (Lepikhin et al. 2020, sec. 3.2: the
dispatch tensor is [E, C, d]) and Switch (Fedus et al. 2021, sec. 2.1): no `int(counts)`, no
`.tolist()` for split sizes, no `nonzero`. Under NCCL each such read would stop the host until the
GPU stream drains (the project's rule: no host read inside a step), and on fake tensors
(refimpl.lab.verify.dryrun) it cannot be answered at all.

The layout. A rank's kept assignments are written into a flat buffer of E * B rows, expert-major:
expert e's rows are [e * B, (e + 1) * B), and an assignment's row inside them is its *slot*, the
number of this rank's kept assignments to e before it (a running count: the cumulative sum of the
one-hot, GShard's "position in expert"). The rows nobody fills stay zero: they are padding.
Dropped assignments go to one extra row past the end (the "dump"), cut off before the experts run.

  B   the most kept assignments one expert can get from this rank: min(C, T) under the batch
      scope (never more than C in all, nor more than one per token), min(rows * C, T) under
      the sequence scope (C per sequence).

Both moves are gathers (index_select), which autograd saves as an index only.

Padding changes no gradient. A padded row's output is never read back (`unpack` gathers only
real rows; the dump reads a zero row), so its output gradient is exactly zero; an expert's weight
and bias gradients are sums over rows of (input x output gradient) and of the output gradient, so
each padded row adds exact zeros (tests/test_moe_slots.py checks it in float64).
"""
from __future__ import annotations

import torch


def one_hot(experts_flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[A, E] long, 1 where assignment a chose expert e. A comparison, not F.one_hot: that checks
    its values' range on the host (an item() on CPU, which fake tensors cannot answer)."""
    ids = torch.arange(n_experts, device=experts_flat.device)
    return (experts_flat[:, None] == ids).long()


def slots(experts_flat: torch.Tensor, kept_hot: torch.Tensor) -> torch.Tensor:
    """[A]: for a kept assignment, how many of this rank's kept assignments to its expert come
    before it (batch order); meaningless for a dropped one. `kept_hot`: one_hot(experts_flat, E)
    with the dropped assignments' rows zeroed (the layer sums it for its per-expert counts too)."""
    return (kept_hot.cumsum(dim=0) - 1).gather(1, experts_flat[:, None]).squeeze(1)


def destinations(experts_flat: torch.Tensor, keep: torch.Tensor, kept_hot: torch.Tensor,
                 bound: int) -> torch.Tensor:
    """[A]: each assignment's row in the [E * bound] buffer, the dump row (E * bound) if dropped."""
    n_experts = kept_hot.shape[1]
    row = experts_flat * bound + slots(experts_flat, kept_hot)
    return torch.where(keep, row, torch.full_like(row, n_experts * bound))


def pack(rows: torch.Tensor, dest: torch.Tensor, n_rows: int,
         row_of: torch.Tensor | None = None) -> torch.Tensor:
    """[n_rows, d]: buffer row dest[i] holds rows[row_of[i]] (row_of: i itself by default; the
    layer passes token a // k for assignment a), every other row zero; the dump is cut off.

    A gather, not a scatter: each buffer row reads its source (or an appended zero row), so
    autograd saves only the index. (index_add would save its whole `rows` argument for the
    backward's expand_as: one more [rows, d] activation per pack.)"""
    row_of = torch.arange(dest.numel(), device=dest.device) if row_of is None else row_of
    source = torch.full((n_rows + 1,), rows.shape[0], dtype=dest.dtype, device=dest.device)
    source = source.scatter(0, dest, row_of)[:n_rows]     # real rows are hit once; the dump is cut
    return unpack(rows, source)


def unpack(buffer: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """[len(dest), d]: buffer's row dest[i], a zero row for the dump: the inverse of `pack`."""
    dump = buffer.new_zeros((1,) + tuple(buffer.shape[1:]))
    return torch.cat([buffer, dump]).index_select(0, dest)


def compact_destinations(recv: torch.Tensor, bound: int, room: int) -> torch.Tensor:
    """Where each received row goes in the experts' buffer (refimpl.parallel.ep.dispatch).

    The all-to-all delivers [sources, E_local, bound] rows, of which the first recv[s, j] of
    each (s, j) are real. Expert j's buffer [room] takes them source after source (source-rank
    order = global batch order), so a real row (s, j, b) goes to j * room + (rows of j from
    the sources before s) + b, padding to the dump row (E_local * room). `room` must hold every
    real row an expert can receive: min(C, sources * bound) under the batch scope."""
    sources, local = recv.shape
    start = recv.cumsum(dim=0) - recv                                     # [sources, E_local]
    b = torch.arange(bound, device=recv.device)
    j = torch.arange(local, device=recv.device)[None, :, None]
    row = j * room + start[:, :, None] + b
    real = b < recv[:, :, None]
    return torch.where(real, row, torch.full_like(row, local * room)).reshape(-1)
