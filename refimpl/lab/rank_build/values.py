"""A rank's parameter values, one tensor at a time: a rank builds only its own shard.

    reference = build_model(cfg.model, seed, device="meta")     # shapes, no storage
    values = RankValues(reference, seed, mesh, device)          # or state=a checkpoint's
    rank_model = model_parallel(reference, ctx)                 # still shapes only
    materialize(rank_model.module, values)                      # or a strategy's own shards
                                                                # (refimpl.lab.rank_build.shard_only)
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn
from torch.utils import swap_tensors

from refimpl.lab.checkpoint.gather import local_part
from refimpl.model.init import init_rules, initial_value
from refimpl.placement import placement_of, set_placement


class PartialState(Mapping):
    """A reference state dict that can read one rank's part of a tensor without the whole
    (a sharded checkpoint, refimpl.lab.checkpoint.sharded_checkpoint): `shape_of` without reading,
    `read_part(name, shape, where, mesh)` = local_part(self[name], shape, where, mesh)."""

    def shape_of(self, name: str) -> tuple:
        raise NotImplementedError

    def read_part(self, name, shape, where, mesh) -> torch.Tensor:
        raise NotImplementedError


def part_of(state: Mapping, name: str, shape, where, mesh) -> torch.Tensor:
    """This rank's part of `state[name]`, reading only that part where the state can."""
    if isinstance(state, PartialState):
        return state.read_part(name, shape, where, mesh)
    return local_part(state[name], shape, where, mesh)


class RankValues:
    """Where a rank's values come from. `reference`: the reference model (meta is enough);
    `state`: a full reference state dict (a checkpoint from any layout, refimpl.compose) or None
    for the seeded init; `device`: where the rank computes."""

    def __init__(self, reference: nn.Module, seed: int, mesh, device,
                 state: Mapping[str, torch.Tensor] | None = None):
        self.rules = init_rules(reference)
        self.shapes = {n: t.shape for n, t in reference.state_dict(keep_vars=True).items()}
        self.seed, self.mesh, self.device = seed, mesh, torch.device(device)
        if state is not None:
            check_state(state, self.shapes)
        self.state = state

    def whole(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The reference's tensor `name`, whole, on the host."""
        if self.state is not None:
            return self.state[name].to(dtype)
        return initial_value(self.rules[name], self.shapes[name], self.seed, dtype)

    def local(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of the reference's `name`, shaped like `like` (the rank model's
        tensor, whose placement says which part), on the host (perhaps a view of the whole);
        an empty meta tensor on meta."""
        return self.part(name, like.shape, like.dtype, placement_of(like))

    def part(self, name: str, shape, dtype: torch.dtype, where) -> torch.Tensor:
        """`local`, from the tensor's shape, dtype and placement."""
        if self.device.type == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        if self.state is not None:
            return part_of(self.state, name, shape, where, self.mesh).to(dtype)
        return local_part(self.whole(name, dtype), shape, where, self.mesh)

    def placed(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """`local` on the rank's device, in a contiguous tensor of its own (never a view that
        would keep the whole host tensor, or a checkpoint's, alive)."""
        value = self.local(name, like)
        if self.device.type == "meta":
            return value
        return torch.empty(like.shape, dtype=like.dtype, device=self.device).copy_(value)

    def of(self, module: nn.Module) -> "LocalValues":
        """`local` of each of `module`'s parameters, by name, made only when read: what a strategy
        hands a mechanism that writes the values into storage of its own (ZeRO's flat buffer, a
        ZeRO-3 shard reading only the parameters that reach into it). Taken before the mechanism
        rebinds the parameters (its gathered buffer may be bf16: the values keep their dtype)."""
        return LocalValues(self, {n: (p.shape, p.dtype, placement_of(p))
                                  for n, p in module.named_parameters()})


class LocalValues(Mapping):
    """name -> this rank's value of that parameter (on the host), made when read."""

    def __init__(self, values: RankValues, described: dict[str, tuple]):
        self.values, self.described = values, described   # name -> (shape, dtype, placement)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.values.part(name, *self.described[name])

    def __iter__(self):
        return iter(self.described)

    def __len__(self) -> int:
        return len(self.described)


def check_state(state: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size]) -> None:
    """A checkpoint must be the reference's state dict: the same names and shapes
    (load_state_dict's strict check, made before any tensor is placed)."""
    missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    shape_of = state.shape_of if isinstance(state, PartialState) else lambda n: state[n].shape
    wrong = [n for n in shapes if tuple(shape_of(n)) != tuple(shapes[n])]
    if wrong:
        n = wrong[0]
        raise RuntimeError(f"checkpoint's {n} has shape {tuple(shape_of(n))}, the model's "
                           f"{tuple(shapes[n])}")


def materialize(module: nn.Module, values: RankValues, parameters: bool = True) -> nn.Module:
    """Give each parameter (unless `parameters` is False) and buffer of `module` its value on
    `values.device`, one tensor at a time, in place. Names are the reference's (every transform
    keeps them); a tied parameter is one tensor, given its value once."""
    named = list(module.named_parameters()) if parameters else []
    for name, t in named + list(module.named_buffers()):
        set_data(t, values.placed(name, t))
    return module


def set_data(t: torch.Tensor, value: torch.Tensor) -> None:
    """Make `t` hold `value`, keeping the tensor object (modules and ties refer to it), its
    placement and its gradient hooks (tensor parallelism's all-reduce of a sequence-partial
    gradient, registered on the shapes). `t.data = value` refuses to turn a meta tensor into a
    real one; torch.utils.swap_tensors swaps the contents instead, and the attributes with them,
    so they are handed over first. The hooks stay registered on the contents swapped out:
    setting the hook dicts again registers them on the new ones (without it tp + sp's gradients
    were not summed)."""
    if t.device == value.device:
        t.data = value
        return
    new = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
        else value
    new.__dict__.update(t.__dict__)
    hooks = t._backward_hooks, t._post_accumulate_grad_hooks
    where = placement_of(t)
    set_placement(t, None)        # swap_tensors refuses a tensor something holds a weak reference to
    swap_tensors(t, new)
    set_placement(t, where)
    t._backward_hooks, t._post_accumulate_grad_hooks = hooks
