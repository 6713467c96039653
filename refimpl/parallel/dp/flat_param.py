"""Many parameters as one flat, padded buffer: the data structure under ZeRO and FSDP."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat buffer."""
    name: str
    offset: int
    numel: int
    shape: torch.Size


class FlatParams:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]], world_size: int):
        self.params = [p for _, p in named_params]
        self.dtype = self.params[0].dtype if self.params else torch.float32   # the master dtype
        self.slots: list[Slot] = []
        offset = 0
        for name, p in named_params:
            self.slots.append(Slot(name, offset, p.numel(), p.shape))
            offset += p.numel()
        self.numel = offset                                   # N, without padding
        self.world_size = world_size
        self.shard_numel = math.ceil(offset / world_size)     # S = ceil(N / world_size)
        self.padded_numel = self.shard_numel * world_size

    def empty(self, dtype=None, device="cpu") -> torch.Tensor:
        """A zero flat buffer, in the parameters' dtype unless told otherwise."""
        return torch.zeros(self.padded_numel, dtype=dtype or self.dtype, device=device)

    def flatten(self, tensors, dtype=None, device="cpu") -> torch.Tensor:
        """A new flat buffer holding one tensor per slot (None: zeros)."""
        flat = self.empty(dtype, device)
        for slot, t in zip(self.slots, tensors):
            if t is not None:
                flat[slot.offset:slot.offset + slot.numel].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's tensor, shaped like its parameter, as a view into `flat` (no copy)."""
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]

    def bind(self, flat: torch.Tensor) -> None:
        """Make every parameter's data a view into `flat`, so writing `flat` updates the model."""
        for p, view in zip(self.params, self.views(flat)):
            p.data = view

    def bind_grads(self, flat_grad: torch.Tensor) -> None:
        """Make every parameter's .grad a view into `flat_grad`; autograd then accumulates there."""
        for p, view in zip(self.params, self.views(flat_grad)):
            p.grad = view

    def take_grads(self, dtype=None, device="cpu") -> torch.Tensor:
        """The gradients in a new flat buffer (None: zeros), each parameter's .grad dropped."""
        flat = self.flatten([p.grad for p in self.params], dtype, device)
        for p in self.params:
            p.grad = None
        return flat

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s contiguous slice of a flat buffer (a view)."""
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    @torch.no_grad()
    def filled_shard(self, read, rank: int, dtype=None, device="cpu", out=None) -> torch.Tensor:
        """Rank `rank`'s slice [r·S, (r+1)·S), filled (into `out` if given) from `read(slot)`
        for the slots reaching into it only: the whole buffer is never built."""
        shard = torch.zeros(self.shard_numel, dtype=dtype or self.dtype, device=device) \
            if out is None else out
        lo = rank * self.shard_numel
        hi = lo + self.shard_numel
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                shard[a - lo:b - lo].copy_(read(slot).reshape(-1)[a - slot.offset:b - slot.offset])
        return shard

    def state_dict(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> full tensor, copied out of a full (gathered) flat buffer."""
        return {s.name: v.detach().clone() for s, v in zip(self.slots, self.views(flat))}
