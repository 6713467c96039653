"""Memory a live run holds: bytes of its model-state tensors (what a strategy reports) and of what
autograd saves for backward (ActivationTracker, the loop's activation peak)."""
from __future__ import annotations

import weakref

import torch

from refimpl.memory.arithmetic import ModelStateBytes


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views and tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = _storage_id(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def per_element(value) -> bool:
    """An optimizer state kept per parameter element (Adam's exp_avg), not a scalar (its step)."""
    return torch.is_tensor(value) and value.dim() > 0


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    """The tensors an optimizer keeps per parameter element."""
    for state in optimizer.state.values():
        yield from (value for value in state.values() if per_element(value))


def measured_model_state(params, optimizer: torch.optim.Optimizer | None) -> ModelStateBytes:
    params = list(params)
    return ModelStateBytes(
        params=tensor_bytes(params),
        grads=tensor_bytes(p.grad for p in params),
        optimizer=tensor_bytes(optimizer_state_tensors(optimizer)) if optimizer else 0,
    )


class ActivationTracker:
    """Counts bytes of the tensors autograd saves for backward, as they are saved and freed.
    Keyed by storage identity, not address: ZeRO-3 frees and re-allocates a gathered parameter."""

    def __init__(self, exclude=()):
        self._excluded = {_storage_id(p) for p in exclude}
        self._live: dict[int, list] = {}   # storage id -> [refcount, nbytes]
        self.current = 0
        self.peak = 0
        self._hooks = None

    def exclude(self, tensors) -> None:
        """Also leave these storages out (e.g. parameters gathered on the fly by ZeRO-3)."""
        self._excluded.update(_storage_id(t) for t in tensors)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, saved: torch.Tensor):
        t = _local(saved)
        key = _storage_id(t)
        if key in self._excluded or isinstance(saved, torch.nn.Parameter) or t.numel() == 0:
            return saved
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, t.untyped_storage().nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(saved, self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes this rank holds: a DTensor's local shard, else the tensor itself."""
    return getattr(t, "_local_tensor", t)


def _storage_id(t: torch.Tensor) -> int:
    """The storage object behind a tensor (stable while it lives, even if resized; fake tensors
    have no address)."""
    return _local(t).untyped_storage()._cdata


class _Saved:
    """A saved tensor plus a finaliser that tells the tracker when autograd let go of it."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor, tracker: ActivationTracker, key: int):
        self.tensor = tensor
        weakref.finalize(self, tracker._release, key)
