"""Memory a live run holds: the bytes of its model-state tensors, counted by storage (a strategy's
held bytes: refimpl.lab.instrument.model_state; the activations autograd saves: activations.py)."""
from __future__ import annotations

import torch

from refimpl.memory import ModelStateBytes


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views and tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = storage_id(t)
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


def storage_id(t: torch.Tensor) -> int:
    """The storage object behind a tensor: stable while it lives, even if resized (not its address:
    fake tensors have none)."""
    return t.untyped_storage()._cdata
