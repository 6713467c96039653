"""AdamW over one rank's shard of a flat parameter buffer: ZeRO's partitioned optimizer states.

AdamW is elementwise: element i's update reads only element i of the weight, the gradient, m and v.
So running torch.optim.AdamW on a 1-D parameter that *is* this rank's slice of the flat buffer,
with the matching slice of the averaged gradient, does exactly the arithmetic `single` does for
those elements -- the rank simply never touches the other elements' m and v (Rajbhandari et al.
2020, §5.1). The zero padding at the end of the last shard stays zero: its gradient is zero, and
AdamW's update of a zero weight with zero gradient and zero moments is zero.

offload=True is ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model
Training", §4): the fp32 master copy of the shard, m and v live in host memory and the update runs
on the CPU; each step the gradient shard is copied device -> host and the updated weights host ->
device. On this CPU-only machine host and device are the same memory, so offload changes where the
bytes are *accounted* and adds the two copies; on a GPU the same code frees 12 bytes per shard
element of GPU memory (16 with the gradient staging) at the cost of PCIe traffic and a CPU Adam.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from refimpl.config import TrainConfig
from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.strategy import make_optimizer


class ShardedAdamW:
    def __init__(self, shard: torch.Tensor, cfg: TrainConfig, offload: bool = False):
        self.shard = shard                    # a view of this rank's slice of the flat parameters
        self.offload = offload
        if offload:
            host = torch.device("cpu")
            pin = shard.device.type == "cuda"  # pinned host memory: faster, async-capable copies
            self.master = nn.Parameter(torch.empty(shard.shape, dtype=shard.dtype, device=host,
                                                      pin_memory=pin))
            with torch.no_grad():
                self.master.copy_(shard)
            self.master.grad = torch.zeros(shard.shape, dtype=shard.dtype, device=host, pin_memory=pin)
        else:
            # A Parameter made from a view shares its storage: the update lands in the flat buffer.
            self.master = nn.Parameter(shard)
        self.optimizer = make_optimizer([self.master], cfg)

    @torch.no_grad()
    def step(self, grad_shard: torch.Tensor) -> None:
        """One AdamW step of this rank's shard, given its slice of the averaged gradient."""
        if self.offload:
            self.master.grad.copy_(grad_shard)            # device -> host
        else:
            self.master.grad = grad_shard
        self.optimizer.step()
        if self.offload:
            self.shard.copy_(self.master)                 # host -> device

    def host_state(self) -> ModelStateBytes:
        """What offload keeps in host memory; the fp32 master copy counts as optimizer state, as in
        the ZeRO paper's K = 12 (master + m + v)."""
        if not self.offload:
            return ModelStateBytes(0, 0, 0)
        held = measured_model_state([self.master], self.optimizer)
        return ModelStateBytes(params=0, grads=held.grads, optimizer=held.params + held.optimizer)
