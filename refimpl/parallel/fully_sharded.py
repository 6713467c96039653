"""Fully sharded data parallelism: when each unit is gathered, freed and reduced (the schedule).

The mechanism of one unit is in `sharded_unit.py`; this file cuts the reference GPT into units and
hooks them into its forward and backward, under a `ShardingPolicy`. `zero3.py` and `fsdp.py` are
two policies of this one class:

  forward   pre-hook of unit i:  wait for / gather its parameters; [prefetch] start gathering i+1
            post-hook of unit i: [reshard_after_forward] free them; hook the unit's output so we
                                 know when its backward begins
  backward  output's grad hook:  gather again (if freed); [prefetch] start gathering unit i-1
            last .grad of unit i accumulated: reduce-scatter its gradient, free its parameters
  step      AdamW on this rank's fp32 shards only (every state sharded: ZeRO-3)

Data parallel throughout: rank r trains on rows [r·B/N, (r+1)·B/N) of the global batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from refimpl.memory import ModelStateBytes, optimizer_state_tensors, tensor_bytes
from refimpl.model import Batch, GPT, lm_loss
from refimpl.parallel.sharded_unit import ShardedUnit
from refimpl.trace.profiling import comm_span, phase
from refimpl.strategy import (LayoutError, Strategy, TrainConfig, make_optimizer,
                              require_equal_rows)


@dataclass(frozen=True)
class ShardingPolicy:
    reshard_after_forward: bool = True   # ZeRO-3 / FULL_SHARD; False: SHARD_GRAD_OP (≈ ZeRO-2)
    keep_last_unit: bool = False         # don't free the unit whose backward comes first (FSDP2's
                                         # root heuristic: it would be gathered again at once)
    prefetch: bool = False               # gather the next unit while this one computes
    async_reduce: bool = False           # reduce-scatter in the background of the next backward


def gpt_units(model: GPT) -> list[tuple[str, list]]:
    """The wrapping policy: (unit name, modules) in forward order -- the embeddings, one unit per
    transformer block (FSDP's transformer auto-wrap policy), and final_norm + lm_head."""
    units = [("embed", [("embed", model.embed)])]
    units += [(f"blocks.{i}", [(f"blocks.{i}", b)]) for i, b in enumerate(model.blocks)]
    units.append(("head", [("final_norm", model.final_norm), ("lm_head", model.lm_head)]))
    return units


class FullySharded(Strategy):
    """Base of `zero3` and `fsdp`; subclasses set `policy(cfg)`."""

    min_world_size = 1
    option_names: tuple[str, ...] = ("offload",)

    @classmethod
    def policy(cls, cfg: TrainConfig) -> ShardingPolicy:
        raise NotImplementedError

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        require_equal_rows(cfg, cfg.nproc)
        if cfg.model.tie_embeddings:
            raise LayoutError(f"strategy {cls.name!r} does not support tied embeddings (the tied "
                              "weight would belong to two units)")
        if cfg.model.n_experts:
            raise LayoutError(f"strategy {cls.name!r} needs a dense model: an expert that gets no "
                              "token would leave its unit's backward unfinished")
        unknown = set(cfg.options) - set(cls.option_names)
        if unknown:
            raise LayoutError(f"strategy {cls.name!r} has no option(s) {sorted(unknown)}; "
                              f"known: {', '.join(cls.option_names)}")
        cls.policy(cfg)   # let the subclass reject its own options

    def setup(self, model: GPT) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg
        self.pol = self.policy(cfg)
        self.group = dist.group.WORLD if dist.is_initialized() else None
        self.model = model.to(ctx.device)
        if cfg.activation_checkpointing:
            from refimpl.parallel.checkpointing import checkpoint_blocks

            checkpoint_blocks(self.model)
        self.offload = bool(cfg.options.get("offload", False))
        master_device = torch.device("cpu") if self.offload else ctx.device
        self.units: list[ShardedUnit] = []
        for name, modules in gpt_units(self.model):
            named = [(f"{prefix}.{n}", p) for prefix, m in modules for n, p in m.named_parameters()]
            unit = ShardedUnit(name, named, self.group, ctx.rank, ctx.world_size, ctx.device,
                               ctx.compute_dtype, master_device)
            self._install_hooks(len(self.units), unit, modules[0][1], modules[-1][1])
            self.units.append(unit)
        self.optimizer = make_optimizer([u.master for u in self.units], cfg)
        self._pending_reduce: list = []

    # --- the schedule -----------------------------------------------------------------------------

    def _install_hooks(self, i: int, unit: ShardedUnit, first, last) -> None:
        first.register_forward_pre_hook(lambda module, args: self._before_forward(i))
        last.register_forward_hook(lambda module, args, out: self._after_forward(i, out))
        for p in unit.flat.params:
            p.register_hook(lambda grad: unit.prepare_grads())     # before it is accumulated
            p.register_post_accumulate_grad_hook(lambda param: self._grad_ready(i))

    def _before_forward(self, i: int) -> None:
        unit = self.units[i]
        unit.wait_gather()
        if self.pol.prefetch and i + 1 < len(self.units):
            self.units[i + 1].gather(async_op=True)   # overlaps with unit i's compute

    def _after_forward(self, i: int, out: torch.Tensor) -> None:
        backward_follows = torch.is_grad_enabled() and out.requires_grad
        keep = self.pol.keep_last_unit and i == len(self.units) - 1
        if not backward_follows or (self.pol.reshard_after_forward and not keep):
            self.units[i].reshard()
        if backward_follows:
            out.register_hook(lambda grad: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        unit = self.units[i]
        unit.wait_gather()
        unit.expect_grads()
        if self.pol.prefetch and i > 0:
            self.units[i - 1].gather(async_op=True)   # overlaps with unit i's backward

    def _grad_ready(self, i: int) -> None:
        unit = self.units[i]
        unit.grads_left -= 1
        if unit.grads_left:
            return
        # The unit's last gradient is in: its backward is over (every op that needed its
        # weights also produced a weight gradient), so free its parameters first, then reduce.
        # At most one reduce-scatter stays in flight: the previous unit's has had this unit's
        # whole backward to finish, and waiting for it here frees its full-size gradient buffer
        # before another is sent.
        unit.reshard()
        self._finish_reduces()
        self._pending_reduce.append(unit.reduce_scatter(async_op=self.pol.async_reduce))

    def _finish_reduces(self) -> None:
        for finish in self._pending_reduce:
            finish()
        self._pending_reduce.clear()

    # --- one step ---------------------------------------------------------------------------------

    def train_step(self, batch: Batch) -> float:
        ctx = self.ctx
        local = batch.to(ctx.device).shard(ctx.rank, ctx.world_size)
        micro = local.micro_batches(ctx.cfg.micro_batches)
        total = torch.zeros((), device=ctx.device)
        for mb in micro:
            with phase("forward"), ctx.autocast():
                loss = lm_loss(self.model(mb.inputs), mb.targets) / len(micro)
            with phase("backward"):
                # Scale by 1/ranks here and sum in the reduce-scatter: dividing each reduced
                # element by ranks instead rounds differently (1/3 is not exact in binary),
                # and drifted past the 1e-5 equivalence bound on 3 ranks.
                (loss / ctx.world_size).backward()
                self._finish_reduces()
            total += loss.detach().float()
        unfinished = [u.name for u in self.units if u.grads_left or u.gathered]
        if unfinished:
            raise RuntimeError(f"units {unfinished} did not finish their backward")
        with phase("optimizer"):
            self.optimizer.step()
            for u in self.units:
                u.master.grad.zero_()
        return self._global_mean(total)

    def _global_mean(self, local: torch.Tensor) -> float:
        with comm_span("all_reduce", local.element_size()):
            dist.all_reduce(local, group=self.group)
        return float(local) / self.ctx.world_size

    # --- reporting --------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for unit in self.units:
            state.update(unit.full_state_dict())
        return state

    def model_state(self) -> ModelStateBytes:
        """Bytes on the compute device: the shards, their gradients, Adam's m and v, and any
        parameters gathered right now. Under offload the shards live on the host instead
        (`shard_state`) and the device keeps only gathered parameters, for as long as needed."""
        gathered = sum(u.gathered_bytes for u in self.units)
        if self.offload:
            return ModelStateBytes(params=gathered, grads=0, optimizer=0)
        shards = self.shard_state()
        return ModelStateBytes(shards.params + gathered, shards.grads, shards.optimizer)

    def shard_state(self) -> ModelStateBytes:
        """Bytes of this rank's fp32 shards, their gradients and Adam's m and v, wherever they
        live (the host, under offload)."""
        masters = [u.master for u in self.units]
        return ModelStateBytes(params=tensor_bytes(masters),
                               grads=tensor_bytes(m.grad for m in masters),
                               optimizer=tensor_bytes(optimizer_state_tensors(self.optimizer)))

    def activation_exclusions(self) -> list[torch.Tensor]:
        # Gathered parameter buffers are model state: autograd saves views of them (W for dX).
        return [u.full for u in self.units]
