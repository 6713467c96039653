"""Fixed-size expert buffers: tokens move without a count read on the host."""
from __future__ import annotations

import torch


def one_hot(experts_flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[A, E] long, 1 where assignment a chose expert e (not F.one_hot: its range check reads the
    host, which fake tensors cannot answer)."""
    ids = torch.arange(n_experts, device=experts_flat.device)
    return (experts_flat[:, None] == ids).long()


def destinations(experts_flat: torch.Tensor, keep: torch.Tensor, kept_hot: torch.Tensor,
                 bound: int) -> torch.Tensor:
    """[A]: each assignment's row in the [E * bound] buffer, after the kept assignments to its expert
    before it (`kept_hot`: one_hot with the dropped rows zeroed); the dump row E * bound if dropped."""
    n_experts = kept_hot.shape[1]
    slot = (kept_hot.cumsum(dim=0) - 1).gather(1, experts_flat[:, None]).squeeze(1)
    row = experts_flat * bound + slot
    return torch.where(keep, row, torch.full_like(row, n_experts * bound))


def pack(rows: torch.Tensor, dest: torch.Tensor, n_rows: int,
         row_of: torch.Tensor | None = None) -> torch.Tensor:
    """[n_rows, d]: row dest[i] holds rows[row_of[i]] (row_of: i by default), the others zero."""
    row_of = torch.arange(dest.numel(), device=dest.device) if row_of is None else row_of
    source = torch.full((n_rows + 1,), rows.shape[0], dtype=dest.dtype, device=dest.device)
    source = source.scatter(0, dest, row_of)[:n_rows]     # real rows are hit once; the dump is cut
    return unpack(rows, source)


def unpack(buffer: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """[len(dest), d]: buffer's row dest[i], a zero row for the dump: the inverse of `pack`."""
    dump = buffer.new_zeros((1,) + tuple(buffer.shape[1:]))
    return torch.cat([buffer, dump]).index_select(0, dest)


def compact_destinations(recv: torch.Tensor, bound: int, room: int) -> torch.Tensor:
    """Where each received row goes in the experts' buffer (refimpl.parallel.ep.dispatch)."""
    sources, local = recv.shape
    start = recv.cumsum(dim=0) - recv                                     # [sources, E_local]
    b = torch.arange(bound, device=recv.device)
    j = torch.arange(local, device=recv.device)[None, :, None]
    row = j * room + start[:, :, None] + b
    real = b < recv[:, :, None]
    return torch.where(real, row, torch.full_like(row, local * room)).reshape(-1)
