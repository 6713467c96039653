"""`zero3`: ZeRO stage 3 -- parameters, gradients and optimizer states all partitioned -- and the
schedule that every fully sharded strategy shares (`fsdp` is this class with another policy).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
§5.3 (P_os+g+p, 파라미터까지 분할): each rank stores 1/N of every model state, so per-rank
model-state memory falls as (2 + 2 + K)·Ψ/N. The price is communication: a unit's parameters are
all-gathered before its forward *and again* before its backward (they were discarded in between),
and its gradients are reduce-scattered when its backward ends -- Ψ + Ψ + Ψ = 3Ψ per step against
plain DP's 2Ψ (§7.2.2). `zero3` is the plain version: nothing is prefetched, every gather waits,
so the trace shows the communication exposed; `fsdp` (fsdp.py) adds the overlap.

The mechanism of one unit is in `sharded_unit.py`; the schedule below is `FullyShard`'s
(`sharded_module.py`, the wrapper a learner puts around a model of their own); this file cuts the
reference GPT into units and wraps it, under a `ShardingPolicy`:

  forward   pre-hook of unit i:  wait for / gather its parameters; [prefetch] start gathering i+1
            post-hook of unit i: [reshard_after_forward] free them; hook the unit's output so we
                                 know when its backward begins
  backward  output's grad hook:  gather again (if freed); [prefetch] start gathering unit i-1
            last .grad of unit i accumulated: reduce-scatter its gradient, free its parameters
  step      AdamW on this rank's fp32 shards only (every state sharded)

Under a pipeline's split schedules (zb-h1, interleaved-zb, zbv, dualpipev) a B computes only the
input gradient: the output hook still fires, so the unit is gathered and its gradients counted as
expected, but they come later, with the W's, which hand them to autograd's accumulator
(refimpl.parallel.pp.zero_bubble): the same hooks bind them into the flat gradient and count them
in. Each W delivers one gradient of every parameter of the unit, and the unit then reduce-scatters
and frees them as after a plain backward, even while later micro-batches' B's still expect theirs
(zb-h1's B's run ahead of its W's). A W reads no weight (dA = dY^T X; LayerNorm's x_hat without
the affine), so it may run on a resharded unit, and nothing waits for it to free them.

The shards are cut over the mesh's dp x cp ranks (refimpl.mesh): on a composed grid each
tensor-parallel or pipeline slice is sharded among the ranks that hold the same slice, and a MoE
block's experts under --ep among the ranks that hold the same experts ("edp": a second flat shard
of the block, gathered, freed and reduce-scattered together with the first).

    python -m refimpl train --strategy zero3 --nproc 2 --set offload=true
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from refimpl.config import Option, TrainConfig
from refimpl.memory import ModelStateBytes, optimizer_state_tensors, tensor_bytes
from refimpl.mesh import LayoutError
from refimpl.model import GPT
from refimpl.parallel.fsdp.sharded_module import FullyShard, ShardingPolicy
from refimpl.placement import data_parallel_axis, gather_full_state_dict
from refimpl.rank_values import RankValues
from refimpl.strategy import Strategy, make_optimizer

__all__ = ["FullySharded", "Zero3", "ShardingPolicy", "gpt_units"]


def gpt_units(model: GPT) -> list[tuple[str, list]]:
    """The wrapping policy: (unit name, modules) in forward order -- the embeddings, one unit per
    transformer block (FSDP's transformer auto-wrap policy), and final_norm + lm_head.

    A pipeline stage (stage.PipelineStageModel) holds only some of them: its blocks keyed by
    their reference index, the embedding only on the first stage, the head only on the last; the
    units are the ones it has, under the same names."""
    blocks = (model.blocks.items() if isinstance(model.blocks, nn.ModuleDict)
              else enumerate(model.blocks))
    units = [("embed", [("embed", model.embed)])] if model.embed is not None else []
    units += [(f"blocks.{i}", [(f"blocks.{i}", b)]) for i, b in blocks]
    if model.lm_head is not None:
        units.append(("head", [("final_norm", model.final_norm), ("lm_head", model.lm_head)]))
    return units


class FullySharded(Strategy):
    """Base of `zero3` and `fsdp`; subclasses set `policy(cfg)`."""

    options = {"offload": Option(False, bool)}
    experts_over_edp = True
    on_a_pipeline = True
    # Each unit makes only this rank's shard of its parameters, one parameter at a time
    # (ShardedUnit._own_shard): the model is never whole on this rank.
    builds_own_parameters = True

    @classmethod
    def policy(cls, cfg: TrainConfig) -> ShardingPolicy:
        raise NotImplementedError

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        if cfg.model.tie_embeddings:
            raise LayoutError(f"strategy {cls.name!r} does not support tied embeddings (the tied "
                              "weight would belong to two units)")

    def setup(self, model: GPT, values: RankValues | None = None) -> None:
        ctx, cfg, mesh = self.ctx, self.ctx.cfg, self.mesh
        self.model = model
        self.offload = bool(self.option("offload"))
        # Each unit of the policy is sharded over the ranks holding the same copy of it: dp x cp,
        # except a MoE block's experts under --ep, which get a ShardedUnit of their own over
        # "edp" (refimpl.placement.data_parallel_axis), gathered and reduced with their block.
        # The gradients are summed, not averaged: each rank's loss was divided by W.
        self.fs = FullyShard(model, units=gpt_units(model), compute_dtype=ctx.compute_dtype,
                             policy=self.policy(cfg), average=False,
                             reduce_over=lambda p: mesh.group(data_parallel_axis(p)),
                             master_device=torch.device("cpu") if self.offload else ctx.device,
                             comm=self.comm, values=values, device=ctx.device)
        self.units = self.fs.units                 # every flat shard, in schedule order
        self.optimizer = make_optimizer([u.master for u in self.units], cfg)

    # --- the runner's hooks (refimpl.strategy.Strategy.train_step) ----------------------------------

    @contextlib.contextmanager
    def micro_step(self, is_last: bool):
        yield
        self.fs.finish_gradient_synchronization()   # every unit's reduce-scatter of this backward

    def sync_gradients(self) -> None:
        # A pipeline's schedule runs its backwards without micro_step: the last reduce is here.
        self.fs.finish_gradient_synchronization()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        for u in self.units:
            u.master.grad.zero_()

    # --- reporting --------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for unit in self.units:            # whole over dp x cp; then any model-parallel axes
            state.update(unit.full_state_dict())
        # and the buffers, replicated (a MoE layer's expert_bias): the state dict minus the units'
        state.update({n: t for n, t in self.model.state_dict().items() if n not in state})
        return gather_full_state_dict(state, self.model, self.mesh, self.comm)

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


class Zero3(FullySharded):
    name = "zero3"

    @classmethod
    def policy(cls, cfg: TrainConfig) -> ShardingPolicy:
        return ShardingPolicy(reshard_after_forward=True, keep_last_unit=False, prefetch=False,
                              async_reduce=False)
