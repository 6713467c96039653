"""What a run is told: the layout and knobs (`TrainConfig`), where a rank runs (`RunContext`), and a
strategy's own knobs (`Option`); checked before any rank starts (refimpl.train.validate). What to
record, save, load or break is the lab's (refimpl.lab.config.LabConfig, the CLI's other flags)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from refimpl.mesh import Mesh, ParallelDims
from refimpl.model import GPTConfig

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class TrainConfig:
    strategy: str = "single"
    nproc: int = 1
    steps: int = 5
    global_batch: int = 8
    seq_len: int = 32
    seed: int = 0
    lr: float = 3e-3
    weight_decay: float = 0.01
    micro_batches: int = 1            # gradient accumulation / pipeline micro-batches
    mixed_precision: str = "fp32"     # "fp32" or "bf16" (autocast compute, fp32 master weights)
    dtype: str = "float32"            # weights, grads, optimizer states ("float64": equivalence tests)
    activation_checkpointing: bool = False
    model: GPTConfig = field(default_factory=GPTConfig)
    device: str = "auto"              # an in-process run's (nproc 1): "auto" = a GPU if there is one
    options: dict = field(default_factory=dict)   # strategy-specific knobs, e.g. {"bucket_mb": 25}
    # The grid (refimpl.mesh): dp = nproc / (replicas x pp x cp x tp).
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    replicas: int = 1                 # independent copies of the layout (tests: group isolation)
    sequence_parallel: bool = False   # with tp > 1: LayerNorm regions split along the sequence
    collectives: str = "torch"        # "refimpl": every collective from refimpl.comm's send/recv
    schedule: str | None = None       # pipeline schedule (pp > 1): gpipe, 1f1b, interleaved, zb-h1, interleaved-zb, zbv, dualpipev
    virtual_stages: int = 1           # model chunks per pipeline rank (interleaved)

    def with_(self, **changes) -> "TrainConfig":
        return replace(self, **changes)

    @property
    def dims(self) -> ParallelDims:
        per_replica = self.replicas * self.pp * self.cp * self.tp
        dp = max(self.nproc // per_replica, 1)
        return ParallelDims(dp=dp, pp=self.pp, cp=self.cp, tp=self.tp, ep=self.ep,
                            replica=self.replicas)


@dataclass
class RunContext:
    """What a strategy is told about where it runs: its place in the grid, its device, its
    collectives. Process groups come from `mesh`, never from a global."""
    rank: int
    world_size: int
    backend: str
    device: torch.device
    cfg: TrainConfig
    mesh: Mesh

    @property
    def param_dtype(self) -> torch.dtype:
        """Weights, gradients, optimizer states and flat buffers (--dtype)."""
        return DTYPES[self.cfg.dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.mixed_precision == "bf16" else self.param_dtype

    def autocast(self):
        """bf16 autocast under --mixed-precision bf16: matmuls in bf16, weights and optimizer
        states stay fp32 (the master copy). bf16 has fp32's exponent range, so unlike fp16 it
        needs no loss scaling."""
        if self.cfg.mixed_precision != "bf16":   # nothing to cast (nor an autocast on `meta`)
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


@dataclass(frozen=True)
class Option:
    """One strategy knob (`--set key=value`): its default and what values it accepts (checked
    before launch: refimpl.lab.layout_rules.check_options)."""
    default: Any
    kind: type = float                # bool, float, int or str
    choices: tuple = ()
    positive: bool = False
