"""The model states a strategy holds right now: the bytes of its parameters, gradients and optimizer
states on its compute device (the loop's `memory`, through refimpl.lab.loop), beside the arithmetic
of refimpl.memory. Each of refimpl's strategies keeps them its own way; a PyTorch twin says."""
from __future__ import annotations

from refimpl.lab.instrument.state_bytes import measured_model_state, optimizer_state_tensors, tensor_bytes
from refimpl.lab.twins.base import TorchTwin
from refimpl.memory import ModelStateBytes
from refimpl.parallel.fsdp.zero3 import FullySharded
from refimpl.parallel.zero.stages import ZeroDataParallel


def model_state(strategy) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer states `strategy` holds now, by storage."""
    if isinstance(strategy, TorchTwin):
        return strategy.model_state()
    if isinstance(strategy, ZeroDataParallel):
        return zero_state(strategy)
    if isinstance(strategy, FullySharded):
        return fully_sharded_state(strategy)
    return measured_model_state(strategy.model.parameters(), strategy.optimizer)   # replicas


def zero_state(strategy: ZeroDataParallel) -> ModelStateBytes:
    """ZeRO-1/2: the whole flat parameters, their gradients and the gradient shard, m and v of the
    shard (offload: the master shard, m and v are on the host)."""
    params, parts = list(strategy.model.parameters()), strategy.groups.parts
    offload = bool(strategy.option("offload"))
    optimizer = 0 if offload else sum(
        tensor_bytes(optimizer_state_tensors(part.optimizer.local)) for part in parts)
    shards = [] if offload else [part.grad_shard for part in parts]
    return ModelStateBytes(params=tensor_bytes(params),
                           grads=tensor_bytes([p.grad for p in params] + shards),
                           optimizer=optimizer)


def fully_sharded_state(strategy: FullySharded) -> ModelStateBytes:
    """ZeRO-3/FSDP: the shards, their gradients, m and v (unless offloaded), and the parameters
    gathered now."""
    gathered = sum(u.full.untyped_storage().nbytes() for u in strategy.units)   # 0: resharded
    if strategy.option("offload"):
        return ModelStateBytes(params=gathered, grads=0, optimizer=0)
    shards = shard_state(strategy)
    return ModelStateBytes(shards.params + gathered, shards.grads, shards.optimizer)


def shard_state(strategy: FullySharded) -> ModelStateBytes:
    """Bytes of this rank's shards, their gradients and Adam's m and v, wherever they live."""
    masters = [u.master for u in strategy.units]
    return ModelStateBytes(params=tensor_bytes(masters),
                           grads=tensor_bytes(m.grad for m in masters),
                           optimizer=tensor_bytes(optimizer_state_tensors(strategy.optimizer)))
