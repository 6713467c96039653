"""Activation bytes measured on a live run: the tensors autograd saves for backward, live and at
their peak (the loop's `activations_peak`, through refimpl.lab.loop), beside refimpl.memory's
arithmetic."""
from __future__ import annotations

import weakref

import torch

from refimpl.lab.instrument.state_bytes import storage_id
from refimpl.lab.twins.base import TorchTwin
from refimpl.model import lm_loss
from refimpl.parallel.fsdp.zero3 import FullySharded


def activation_exclusions(strategy) -> list[torch.Tensor]:
    """Tensors that autograd saves but that are model state, not activations: Linear's backward
    saves weight.t(), a view that is not a Parameter (~5 MB here), and ZeRO-3/FSDP saves views of
    its gathered parameters (each unit's `full`). A PyTorch twin says which are its own."""
    if isinstance(strategy, TorchTwin):
        return strategy.activation_exclusions()
    if isinstance(strategy, FullySharded):
        return [u.full for u in strategy.units]
    return list(strategy.model.parameters())


class ActivationTracker:
    """Counts bytes of the tensors autograd saves for backward, as they are saved and freed.
    Keyed by storage identity, not address: ZeRO-3 frees and re-allocates a gathered parameter."""

    def __init__(self, exclude=()):
        self._excluded = {storage_id(local_tensor(p)) for p in exclude}
        self._live: dict[int, list] = {}   # storage id -> [refcount, nbytes]
        self.current = 0
        self.peak = 0
        self._hooks = None

    def exclude(self, tensors) -> None:
        """Also leave these storages out (e.g. parameters gathered on the fly by ZeRO-3)."""
        self._excluded.update(storage_id(local_tensor(t)) for t in tensors)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, saved: torch.Tensor):
        t = local_tensor(saved)
        key = storage_id(t)
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


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes this rank holds: a DTensor's local shard, else the tensor itself."""
    return getattr(t, "_local_tensor", t)


class _Saved:
    """A saved tensor plus a finaliser that tells the tracker when autograd let go of it."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor, tracker: ActivationTracker, key: int):
        self.tensor = tensor
        weakref.finalize(self, tracker._release, key)


def measure_block_activations(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Peak bytes saved for backward by one forward of `block` on input `x` (parameters excluded)."""
    x = x.detach().requires_grad_()
    with ActivationTracker(exclude=block.parameters()) as tracker:
        block(x)
    return tracker.peak


def measure_step_activations(model: torch.nn.Module, inputs: torch.Tensor,
                             targets: torch.Tensor) -> int:
    """Peak bytes saved for backward over a whole forward + backward of the model and its loss."""
    with ActivationTracker(exclude=model.parameters()) as tracker:
        lm_loss(model(inputs), targets).backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak
