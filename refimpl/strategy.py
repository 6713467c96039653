"""What a parallelism strategy is: the three things it owns, and the context it is given.

The training loop (`refimpl.train`) is written once: data, seeding, timing, memory accounting,
profiling and the JSON result. A strategy plugs into it and owns exactly three things:

  1. placement   `setup(model)`: how the reference model's weights live on this rank
                 (replicated, flat-sharded, sliced for TP, cut into pipeline stages, experts spread);
  2. one step    `train_step(batch)`: given the *global* batch (every rank can generate it, it is
                 tiny) take this rank's view of it -- rows for DP, all rows for TP, micro-batches for
                 PP -- run forward, backward, communication and the optimizer, and return the
                 global loss (the mean over every token of the global batch);
  3. gathering   `full_state_dict()`: the reference model's state dict, reassembled, so that any
                 strategy's result can be compared with `single`'s and loaded by any other.

Layout constraints are checked by `validate(cfg)` in the *launching* process, before any rank
starts, so a layout that cannot work fails with one line instead of a hang.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import torch

from refimpl.memory import ModelStateBytes
from refimpl.model import Batch, GPT, GPTConfig


class LayoutError(ValueError):
    """A layout that cannot work; the message is one line naming the constraint."""


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
    mixed_precision: str = "fp32"     # "fp32" (exact comparisons) or "bf16" (autocast compute)
    activation_checkpointing: bool = False
    profile: bool = False
    trace_dir: str | None = None      # where --profile writes; default profiles/cli/<strategy>-<n>
    return_state: bool = False        # include the full state dict in each rank's result
    init_state: str | None = None     # torch.save'd full state dict to start from (any strategy's)
    model: GPTConfig = field(default_factory=GPTConfig)
    # Where an in-process run (nproc 1) computes: "auto" = a GPU if there is one. A reference for
    # an N-rank comparison sets the ranks' device (equivalence.ranks_device), so the two never
    # straddle CPU and GPU. Ranks themselves always compute where their backend puts them.
    device: str = "auto"
    options: dict = field(default_factory=dict)   # strategy-specific knobs, e.g. {"bucket_mb": 25}

    def with_(self, **changes) -> "TrainConfig":
        return replace(self, **changes)

    def validate(self) -> None:
        """Constraints every strategy shares; each strategy adds its own in `Strategy.validate`."""
        if self.steps < 1:
            raise LayoutError(f"--steps must be >= 1 (got {self.steps})")
        if self.nproc < 1:
            raise LayoutError(f"--nproc must be >= 1 (got {self.nproc})")
        if self.global_batch < 1 or self.global_batch % self.micro_batches:
            raise LayoutError(f"global batch {self.global_batch} must be a positive multiple of "
                              f"--micro-batches {self.micro_batches}")
        if not 1 <= self.seq_len <= self.model.seq_len:
            raise LayoutError(f"--seq-len must be in [1, {self.model.seq_len}] (got {self.seq_len})")
        if self.mixed_precision not in ("fp32", "bf16"):
            raise LayoutError(f"--mixed-precision must be fp32 or bf16 (got {self.mixed_precision})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise LayoutError(f"device must be auto, cpu or cuda (got {self.device})")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise LayoutError("device cuda asked for, but torch sees no GPU on this machine")


@dataclass
class RunContext:
    """What a strategy is told about where it runs. Process groups are built from it, not imported."""
    rank: int
    world_size: int
    backend: str
    device: torch.device
    cfg: TrainConfig

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.mixed_precision == "bf16" else torch.float32

    def autocast(self):
        """bf16 autocast under --mixed-precision bf16: matmuls in bf16, weights and optimizer
        states stay fp32 (the master copy). bf16 has fp32's exponent range, so unlike fp16 it
        needs no loss scaling."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.mixed_precision == "bf16")


class Strategy(ABC):
    """One way to train the reference model on `ctx.world_size` ranks. See the module docstring."""

    name: str = ""
    min_world_size: int = 1
    max_world_size: int | None = None

    def __init__(self, ctx: RunContext):
        self.ctx = ctx

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        """Raise LayoutError (one line) if this strategy cannot run `cfg`. Runs before launch."""
        if cfg.nproc < cls.min_world_size:
            raise LayoutError(f"strategy {cls.name!r} needs --nproc >= {cls.min_world_size}")
        if cls.max_world_size is not None and cfg.nproc > cls.max_world_size:
            raise LayoutError(f"strategy {cls.name!r} runs on at most {cls.max_world_size} "
                              f"process(es), got --nproc {cfg.nproc}")

    @abstractmethod
    def setup(self, model: GPT) -> None:
        """Place the reference model (built identically on every rank) on this rank."""

    @abstractmethod
    def train_step(self, batch: Batch) -> float:
        """One optimizer step on the global batch; return the global mean loss (same on all ranks)."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The reference model's full state dict (reference names, full shapes, on CPU).

        Collective: every rank must call it. Every rank returns the same dict."""

    @abstractmethod
    def model_state(self) -> ModelStateBytes:
        """Bytes of parameters, gradients and optimizer states this rank holds right now."""

    def activation_exclusions(self) -> list[torch.Tensor]:
        """Tensors that autograd saves but that are model state, not activations (e.g. gathered
        ZeRO-3 parameters); the activation tracker leaves them out."""
        return []


def require_equal_rows(cfg: TrainConfig, ranks: int) -> None:
    """Data-parallel ranks each take an equal share of the global batch, cut into micro-batches."""
    rows = ranks * cfg.micro_batches
    if cfg.global_batch % rows:
        raise LayoutError(f"global batch {cfg.global_batch} must be a multiple of {ranks} data-"
                          f"parallel rank(s) x --micro-batches {cfg.micro_batches} (= {rows}): "
                          f"every rank takes equal rows")


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The one optimizer every strategy uses: AdamW, so the arithmetic has m and v.

    foreach=False: the per-tensor path does the same arithmetic in the same order as our
    from-scratch sharded optimizers, which keeps equivalence at fp32 round-off.
    """
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
