"""When each unit is gathered, freed and reduced (ZeRO-3, Rajbhandari et al. 2020 §5.3; FSDP, Zhao
et al. 2023 §3), over one group, from module and gradient hooks:

  forward   pre-hook of unit i:  gather its parameters [prefetch: post unit i+1's all-gather]
            post-hook:           [reshard_after_forward] free them; hook the unit's output
  backward  the output's grad:   gather again if freed [prefetch: unit i-1's]
            its last gradient:   free the parameters [land unit i-1's all-gather], reduce-scatter
                                 the gradient into the shard
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

import torch
from torch.autograd.graph import register_multi_grad_hook

from refimpl.parallel.fsdp.sharded_unit import ShardedUnit
from refimpl.placement import mark_resharded

ROOT = "root"


@dataclass(frozen=True)
class ShardingPolicy:
    reshard_after_forward: bool = True   # ZeRO-3 / FULL_SHARD; False: SHARD_GRAD_OP (≈ ZeRO-2)
    keep_last_unit: bool = False         # keep gathered the unit whose backward comes first
    prefetch: bool = False               # gather the next unit while this one computes
    async_reduce: bool = False           # reduce-scatter in the background of the next backward
    average: bool = True                 # mean over ranks (False: each rank's loss was divided)
    offload: bool = False                # shards, gradients and optimizer on the host


def assign_params(units, trainable) -> tuple[list, list]:
    """[(unit name, modules, [(name, param)...])]: each unit with the `trainable` parameters it
    alone holds; and the rest (no unit's, or several's), the root unit, gathered all forward."""
    holders: dict[int, set[int]] = {}
    for i, (_, modules) in enumerate(units):
        for _, m in modules:
            for p in m.parameters():
                holders.setdefault(id(p), set()).add(i)
    own, root = [[] for _ in units], []
    for n, p in trainable:
        held = holders.get(id(p), set())
        (own[next(iter(held))] if len(held) == 1 else root).append((n, p))
    return [(name, modules, named) for (name, modules), named in zip(units, own)], root


class UnitSchedule:
    """A ShardedUnit over `group` per unit of assign_params (None where it has no parameters)."""

    def __init__(self, units, root, group, policy: ShardingPolicy, device: torch.device,
                 compute_dtype: torch.dtype | None):
        self.policy = policy
        master = torch.device("cpu") if policy.offload else device
        self.at = [ShardedUnit(name, named, group, device, compute_dtype or named[0][1].dtype,
                               master, policy.average) if named else None
                   for name, _, named in units + ([(ROOT, None, root)] if root else [])]
        self.last = len(units) - 1
        self.root = len(units) if root else None
        self.units = [u for u in self.at if u is not None]    # every flat shard, in order
        self._cast = partial(_cast_inputs, dtype=compute_dtype, device_type=device.type)
        self._pending_reduce: list = []
        self._install_hooks([modules for _, modules, _ in units])

    def _install_hooks(self, modules_of: list) -> None:
        this = weakref.ref(self)    # held weakly: no cycle through the parameters
        for i, modules in enumerate(modules_of):
            first, last = modules[0][1], modules[-1][1]
            first.register_forward_pre_hook(lambda m, args, i=i: this().before_forward(i, args))
            last.register_forward_hook(lambda m, args, out, i=i: this().after_forward(i, out))
        for i, unit in enumerate(self.at):
            for p in [] if unit is None else unit.flat.params:
                mark_resharded(p)     # whole only while gathered (zero bubble)
                p.register_post_accumulate_grad_hook(lambda _p, i=i: this()._grad_ready(i))

    def _neighbour(self, i: int, step: int) -> ShardedUnit | None:
        """The nearest unit of this group after (step 1) or before (-1) unit i, in forward order."""
        j = i + step
        while 0 <= j <= self.last and self.at[j] is None:
            j += step
        return self.at[j] if 0 <= j <= self.last and i != self.root else None

    def before_forward(self, i: int, args: tuple = ()):
        if self.at[i] is not None:
            self.at[i].wait_gather()
        following = self._neighbour(i, 1) if self.policy.prefetch else None
        if following is not None:
            following.gather(async_op=True)    # overlaps with unit i's compute
        return self._cast(args)

    def after_forward(self, i: int, out) -> None:
        outputs = [t for t in _tensors(out) if t.requires_grad]
        backward_follows = torch.is_grad_enabled() and bool(outputs)
        keep = i == self.root or (self.policy.keep_last_unit and i == self.last)
        if self.at[i] is not None and (
                not backward_follows or (self.policy.reshard_after_forward and not keep)):
            self.at[i].reshard()
        if backward_follows:      # at the first of the outputs' gradients, once per backward
            this = weakref.ref(self)
            register_multi_grad_hook(outputs, lambda _grad: this()._before_backward(i), mode="any")

    def _before_backward(self, i: int) -> None:
        unit = self.at[i]
        if unit is not None:
            unit.wait_gather()
            unit.grads_left += len(unit.flat.params)   # added: a B may start before a W delivered
        preceding = self._neighbour(i, -1) if self.policy.prefetch else None
        if preceding is not None:
            preceding.gather(async_op=True)    # overlaps with unit i's backward

    def _grad_ready(self, i: int) -> None:
        unit = self.at[i]
        unit.grads_left -= 1
        unit.delivered += 1
        if unit.delivered < len(unit.flat.params):
            return
        # every parameter's gradient is in: free the parameters, finish the previous unit's
        # reduce-scatter (one in flight at most), land the unit prefetched for the next backward
        # (an all-gather in flight holds a unit-sized receive buffer: not beside this gradient),
        # start this one's
        self._release(unit)
        self._finish_reduces()
        preceding = self._neighbour(i, -1) if self.policy.prefetch else None
        if preceding is not None and preceding.pending_gather is not None:
            preceding.wait_gather()
        self._send(unit)

    def _release(self, unit: ShardedUnit) -> None:
        unit.delivered = max(unit.delivered - len(unit.flat.params), 0)
        unit.reshard()

    def _send(self, unit: ShardedUnit) -> None:
        self._pending_reduce.append(unit.reduce_scatter(async_op=self.policy.async_reduce))

    def _finish_reduces(self) -> None:
        for finish in self._pending_reduce:
            finish()
        self._pending_reduce.clear()

    def finish_gradient_synchronization(self) -> None:
        """Every reduce-scatter done, also those of units a backward left short (a parameter off
        the loss: its zero is reduced too, every rank issuing the same collectives)."""
        self._finish_reduces()
        for unit in self.units:
            if unit.delivered or unit.grads_left:
                self._release(unit)
                self._send(unit)
            unit.grads_left = 0
            unit.reshard()                    # a unit whose backward never came (off the loss)
        self._finish_reduces()


def _cast_inputs(args: tuple, dtype: torch.dtype | None, device_type: str):
    """A unit's floating inputs in the compute dtype, unless autocast picks each op's dtype."""
    if dtype is None or (device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)):
        return None
    cast = [torch.is_tensor(a) and a.is_floating_point() and a.dtype != dtype for a in args]
    return tuple(a.to(dtype) if c else a for a, c in zip(args, cast)) if any(cast) else None


def _tensors(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []
