"""`FullyShard`: ZeRO-3 / FSDP around any `nn.Module` -- the schedule `zero3` and `fsdp` run.

    model = FullyShard(MyNet().to(device))            # each child holding parameters: one unit
    opt = torch.optim.AdamW(model.parameters())       # the local shards: 1/W of every unit
    loss_fn(model(x_rank), y_rank).backward()         # units gathered, used, freed, reduced
    model.finish_gradient_synchronization()           # every shard's .grad: the mean over ranks
    opt.step(); opt.zero_grad()
    full = model.full_state_dict()                    # {name: whole tensor}, MyNet's names

A unit is a group of modules that compute together (`units`: module classes or names; default:
each child module that holds parameters). Its trainable parameters are one flat shard per rank
(refimpl.parallel.fsdp.sharded_unit), and hooks run the schedule (Rajbhandari et al. 2020, §5.3;
Zhao et al. 2023, §3):

  forward   pre-hook of unit i:  gather its parameters [prefetch: start gathering unit i+1]
            post-hook:           [reshard_after_forward] free them; hook the unit's output, so
                                 the start of its backward is known
  backward  the output's grad:   gather again if freed [prefetch: unit i-1]
            its last gradient:   free the parameters, reduce-scatter the gradient into the shards

Which parameters are in which unit: a trainable parameter that exactly one unit holds is that
unit's; one held by none (the root module's own) or by several (a weight tied between two layers)
belongs to the root unit, gathered for the whole forward and backward and reduced once, when its
one gradient is in (FSDP2 puts shared parameters in a common ancestor the same way). A frozen
parameter (requires_grad=False) and the buffers are left whole on every rank and never
communicated. A unit the forward does not use is never gathered and reduces nothing (its shard's
gradient stays zero); a unit that the forward reaches but one of whose parameters gets no gradient
is reduced at `finish_gradient_synchronization()`, the zero with it -- so every rank issues the
same collectives as long as every rank runs the same forward.

With `compute_dtype` (bf16) the parameters are gathered and used in that dtype and each unit's
floating inputs cast to it (FSDP2's MixedPrecisionPolicy param_dtype; under autocast, autocast
decides instead); the shards, their gradients
(reduced in fp32) and the optimizer stay fp32. Unlike DataParallel, nothing is broadcast: every
rank must build the same model (the same seed), as with FSDP2.

The `zero3` and `fsdp` strategies are this class around the transformed GPT, with the loop's
options beyond the contract: `units` as (name, [(prefix, module), ...]) pairs (the GPT's final_norm
and lm_head compute together), `policy` (prefetch, resharding, the kept last unit),
`average=False` (each rank's loss was divided by W), `reduce_over` (a MoE's experts over their
own ranks: a second shard of the same unit), `master_device` (ZeRO-Offload) and `comm`.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.parallel.dp.wrapping import check_devices, claim, group_size, named_state, resolve_group
from refimpl.parallel.fsdp.sharded_unit import ShardedUnit
from refimpl.placement import mark_resharded


@dataclass(frozen=True)
class ShardingPolicy:
    reshard_after_forward: bool = True   # ZeRO-3 / FULL_SHARD; False: SHARD_GRAD_OP (≈ ZeRO-2)
    keep_last_unit: bool = False         # don't free the unit whose backward comes first (FSDP2's
                                         # root heuristic: it would be gathered again at once)
    prefetch: bool = False               # gather the next unit while this one computes
    async_reduce: bool = False           # reduce-scatter in the background of the next backward


ROOT = "root"


class FullyShard(nn.Module):
    """Shards `module`'s parameters unit by unit over `group` (default: the whole world).

    `.module` is the wrapped module, `forward` its forward; `parameters()` are this rank's shards
    (one per unit), each with a `.grad` the reduce-scatter fills. See the module docstring."""

    def __init__(self, module: nn.Module, *, group=None, compute_dtype: torch.dtype | None = None,
                 units=None, policy: ShardingPolicy = ShardingPolicy(), average: bool = True,
                 reduce_over: Callable[[nn.Parameter], object] | None = None,
                 master_device: torch.device | None = None, comm=dist,
                 values=None, device: torch.device | None = None):
        super().__init__()
        who = "FullyShard"
        claim(module, who)
        group = resolve_group(group, who)
        # `values` (refimpl.rank_values.RankValues): the parameters may be shapes only (meta), each
        # unit's shard then made from it on `device`, never the whole unit (a rank that builds
        # only its own shard: the zero3 and fsdp strategies)
        check_devices([(n, t) for n, t in named_state(module)
                       if values is None or t.device.type != "meta"], group, who)
        self.module = module
        self.policy = policy
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if device is None:
            device = trainable[0][1].device if trainable else torch.device("cpu")
        self._device_type = device.type
        # Each unit's trainable parameters; shared or unowned ones go to the root unit.
        unit_modules = resolve_units(module, units)
        holders: dict[int, set[int]] = {}
        for i, (_, modules) in enumerate(unit_modules):
            for _, m in modules:
                for p in m.parameters():
                    if p.requires_grad:
                        holders.setdefault(id(p), set()).add(i)
        own = [[] for _ in unit_modules]
        root = []
        for n, p in trainable:
            held = holders.get(id(p), set())
            (own[next(iter(held))] if len(held) == 1 else root).append((n, p))

        def shards(name: str, named: list) -> list[ShardedUnit]:
            # one flat shard per group the parameters are reduced over (a MoE block's experts:
            # a second one over their own ranks), dense first
            by_group: dict[int, tuple] = {}
            for n, p in named:
                g = reduce_over(p) if reduce_over is not None else group
                by_group.setdefault(id(g), (g, []))[1].append((n, p))
            parts = []
            for k, (g, part) in enumerate(by_group.values()):
                size = 1 if g is None else group_size(g)
                parts.append(ShardedUnit(
                    name if k == 0 else f"{name}.experts", part, g if size > 1 else None,
                    dist.get_rank(g) if size > 1 else 0, size, device,
                    compute_dtype or part[0][1].dtype, master_device or device, comm=comm,
                    average=average, values=values))
            return parts

        self.units: list[ShardedUnit] = []      # every flat shard, in schedule order
        self.at: list[list[ShardedUnit]] = []   # the shards of each unit of the schedule
        self._root: int | None = None
        for (name, modules), named in zip(unit_modules, own):
            if named:
                self._install_hooks(len(self.at), modules, compute_dtype)
                self.at.append(shards(name, named))
        self._regular = len(self.at)            # the units that prefetch one another
        if root:
            self._root = len(self.at)
            self.at.append(shards(ROOT, root))
        for parts in self.at:
            self.units += parts
        for i, parts in enumerate(self.at):
            self._install_grad_hooks(i, parts)
        self._pending_reduce: list = []

    # --- what a user calls ---------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._root is None:
            return self.module(*args, **kwargs)
        self._before_forward(self._root)
        out = self.module(*args, **kwargs)
        self._after_forward(self._root, out)
        return out

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's shards, one per unit (what an optimizer steps)."""
        for u in self.units:
            yield (f"{prefix}.{u.name}" if prefix else u.name), u.master

    def finish_gradient_synchronization(self) -> None:
        """Every reduce-scatter done (and those of units whose backward missed a parameter, now):
        each shard's .grad holds its part of the gradient averaged over the group."""
        self._finish_reduces()
        for i, parts in enumerate(self.at):
            if any(u.delivered for u in parts) or any(u.grads_left for u in parts):
                self._release(i)              # a parameter of the unit got no gradient: zero
                self._send(i)
            for u in parts:
                u.grads_left = 0
                u.reshard()                   # a unit whose backward never came (off the loss)
        self._finish_reduces()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: whole tensor} with the wrapped module's names (a tied weight under each of
        its names), on the CPU. Collective: every rank calls it."""
        whole: dict[str, torch.Tensor] = {}
        for u in self.units:
            whole.update(u.full_state_dict())
        by_id = {}
        for u in self.units:
            for slot, p in zip(u.flat.slots, u.flat.params):
                by_id[id(p)] = whole[slot.name]
        out = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            out[name] = by_id[id(p)] if id(p) in by_id else p.detach().cpu().clone()
        for name, b in self.module.named_buffers():
            out[name] = b.detach().cpu().clone()
        return out

    # --- the schedule ------------------------------------------------------------------------------

    def _install_hooks(self, i: int, modules: list, compute_dtype) -> None:
        first, last = modules[0][1], modules[-1][1]
        this = _weak(self)
        device_type = self._device_type

        def before(module, args):
            this()._before_forward(i)
            # Under autocast (the loop's --mixed-precision) autocast picks each op's dtype: the
            # residual stream stays fp32. Otherwise a bf16 weight needs bf16 inputs.
            cast = [torch.is_tensor(a) and a.is_floating_point() and a.dtype != compute_dtype
                    for a in args]
            if compute_dtype is not None and any(cast) and not _autocasting(device_type):
                return tuple(a.to(compute_dtype) if c else a for a, c in zip(args, cast))

        first.register_forward_pre_hook(before)
        last.register_forward_hook(lambda module, args, out: this()._after_forward(i, out))

    def _install_grad_hooks(self, i: int, parts: list[ShardedUnit]) -> None:
        this = _weak(self)
        for unit in parts:
            for p in unit.flat.params:
                # A pipeline's zero bubble runs the first chunk's W as its whole backward,
                # rereading its saved weights, unless a parameter is marked resharded
                # (refimpl.placement): a unit freed after its B would have none to reread.
                mark_resharded(p)
                p.register_post_accumulate_grad_hook(
                    lambda param, unit=unit: this()._grad_ready(i, unit))

    def _before_forward(self, i: int) -> None:
        for unit in self.at[i]:
            unit.wait_gather()
        if self.policy.prefetch and i + 1 < self._regular:
            for unit in self.at[i + 1]:
                unit.gather(async_op=True)    # overlaps with unit i's compute

    def _after_forward(self, i: int, out) -> None:
        outputs = [t for t in _tensors(out) if t.requires_grad]
        backward_follows = torch.is_grad_enabled() and bool(outputs)
        keep = i == self._root or (self.policy.keep_last_unit and i == self._regular - 1)
        if not backward_follows or (self.policy.reshard_after_forward and not keep):
            for unit in self.at[i]:
                unit.reshard()
        if backward_follows:
            this, fired = _weak(self), []

            def started(grad):
                if not fired:                 # once per forward call, whichever output first
                    fired.append(True)
                    this()._before_backward(i)

            for t in outputs:
                t.register_hook(started)

    def _before_backward(self, i: int) -> None:
        for unit in self.at[i]:
            unit.wait_gather()
            unit.expect_grads()
        if self.policy.prefetch and 0 < i < self._regular:
            for unit in self.at[i - 1]:
                unit.gather(async_op=True)    # overlaps with unit i's backward

    def _grad_ready(self, i: int, unit: ShardedUnit) -> None:
        unit.grads_left -= 1
        unit.delivered += 1
        # every part of the unit (dense, and its experts under --ep) has a whole set in
        if any(part.delivered < len(part.flat.params) for part in self.at[i]):
            return
        # A whole set is in: one backward's gradient of every parameter (or one W's, under a split
        # pipeline schedule, with the B's of later micro-batches perhaps still expecting theirs).
        # The backward is over (every op that needed the weights has run: W needs none), so free
        # the parameters first, then reduce. At most one reduce-scatter stays in flight: the
        # previous unit's has had this unit's whole backward to finish, and waiting for it here
        # frees what it holds (the transport's full-size copy of the gradient, and the shard it
        # reduced into) before another is sent.
        self._release(i)
        self._finish_reduces()
        self._send(i)

    def _release(self, i: int) -> None:
        for part in self.at[i]:
            part.delivered = max(part.delivered - len(part.flat.params), 0)
            part.reshard()

    def _send(self, i: int) -> None:
        for part in self.at[i]:    # dense over dp x cp, then experts over edp: every rank alike
            self._pending_reduce.append(part.reduce_scatter(async_op=self.policy.async_reduce))

    def _finish_reduces(self) -> None:
        for finish in self._pending_reduce:
            finish()
        self._pending_reduce.clear()


def resolve_units(module: nn.Module, units) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """(unit name, [(prefix, module), ...]) in forward (registration) order. `units`: None (each
    child holding a trainable parameter), module classes and/or names (the outermost match
    wins), or such pairs already."""
    if units is None:
        return [(n, [(n, c)]) for n, c in module.named_children()
                if any(p.requires_grad for p in c.parameters())]
    units = list(units)
    if units and isinstance(units[0], tuple):
        return units
    classes = tuple(u for u in units if isinstance(u, type))
    wanted = {u for u in units if isinstance(u, str)}
    known = {n for n, _ in module.named_modules()}
    if wanted - known:
        raise ValueError(f"FullyShard: no submodule named {sorted(wanted - known)}")
    picked: list = []
    for n, m in module.named_modules():
        if not n or any(n.startswith(p + ".") for p, _ in picked):
            continue
        if (classes and isinstance(m, classes)) or n in wanted:
            picked.append((n, m))
    return [(n, [(n, m)]) for n, m in picked]


def _tensors(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _autocasting(device_type: str) -> bool:
    return device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)


def _weak(obj):
    """A weak reference for hooks: no cycle through the parameters' hooks (GradBuckets says why)."""
    return weakref.ref(obj)
