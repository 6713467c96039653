"""What ZeRO-Offload keeps in host memory: a ShardedOptimizer's (refimpl.parallel.zero) master
shard, its gradient, and the optimizer's state; the master copy counts as optimizer state (the
ZeRO paper's K = 12 for fp32 AdamW: master + m + v)."""
from __future__ import annotations

from refimpl.lab.instrument.state_bytes import measured_model_state
from refimpl.memory import ModelStateBytes


def host_state(optimizer) -> ModelStateBytes:
    """Bytes a ShardedOptimizer holds on the host (all zero without offload)."""
    if not optimizer.offload:
        return ModelStateBytes(0, 0, 0)
    held = measured_model_state([optimizer.master], optimizer.local)
    return ModelStateBytes(params=0, grads=held.grads, optimizer=held.params + held.optimizer)
