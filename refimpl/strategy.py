"""What a parallelism strategy is: placement plus synchronisation, around one step runner.

The training loop (`refimpl.train`) is written once: data, seeding, timing, memory accounting,
profiling and the JSON result. The step is written once too (`Strategy.train_step` below, with the
runner in `refimpl.step`): this rank's micro-batches, forward and backward, the optimizer, the
global loss. A strategy fills in only what makes it itself:

  1. placement   `setup(model)`: how the reference model's weights live on this rank. The model
                 first goes through `refimpl.parallel.transforms.model_parallel` (pipeline split,
                 tensor parallel, expert parallel, activation checkpointing: each a function of the
                 module and its axis's group); the strategy then wraps it for the dp axis
                 (replicate: dp-naive, dp; shard: zero1/2/3, fsdp) and builds its optimizer;
  2. sync        `micro_step(is_last)`, `sync_gradients()`, `optimizer_step()`: when and how the
                 data-parallel ranks agree on the gradient, and who updates what;
  3. gathering   `full_state_dict()`: the reference model's state dict, reassembled, so that any
                 strategy's result can be compared with `single`'s and loaded by any other.

Every rank is a point of one grid (`refimpl.mesh`): a data-parallel strategy works on the dp axis
only (its rank and size are `mesh.index("dp")`, `mesh.size("dp")`, its collectives run on
`mesh.group("dp_cp")`), never on the default group, so it composes with the other axes.

Layout constraints are checked by `validate(cfg)` in the *launching* process, before any rank
starts, so a layout that cannot work fails with one line instead of a hang.

Why the loss is scaled by 1/W (and the gradients then summed), once for every strategy: DDP divides
every gradient element by W after summing (Li et al. 2020, §4.2). Same maths; but 1/W applied once,
at the top of backward, rounds once, where dividing N gradient elements rounds N times, and with
W = 3 (1/3 is inexact in binary) that doubled the distance to `single`'s weights (~5e-6 vs ~1.1e-5
after 3 steps). The torch twins keep DDP's way (`scales_loss_by_world = False`).
"""
from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from refimpl.memory import ModelStateBytes
from refimpl.mesh import LayoutError, Mesh, ParallelDims
from refimpl.model import GPT, Batch, GPTConfig, lm_loss
from refimpl.step import forward_backward, global_mean_loss
from refimpl.trace.profiling import phase

__all__ = ["LayoutError", "TrainConfig", "RunContext", "Strategy", "Option", "make_optimizer"]

COLLECTIVES = ("torch", "refimpl")
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
    # The dtype of weights, gradients and optimizer states. "float64" is the equivalence tests'
    # dtype: reordered sums then differ by ~1e-15, so a gate at 1e-9 proves the maths on any
    # processor (refimpl.parallel.equivalence); "float32" is what training uses.
    dtype: str = "float32"
    activation_checkpointing: bool = False
    profile: bool = False
    trace_dir: str | None = None      # where --profile writes; default profiles/cli/<strategy>-<n>
    return_state: bool = False        # include the full state dict in each rank's result
    init_state: str | None = None     # torch.save'd full state dict to start from (any strategy's)
    init_optimizer_state: str | None = None   # AdamW's m, v, step in reference names (optim_reshard)
    return_optimizer_state: bool = False      # include them, gathered, in rank 0's result
    record_memory: bool = False       # measure each rank's peak inside a step (memory[r].peak)
    model: GPTConfig = field(default_factory=GPTConfig)
    # Where an in-process run (nproc 1) computes: "auto" = a GPU if there is one. A reference for
    # an N-rank comparison sets the ranks' device (equivalence.ranks_device), so the two never
    # straddle CPU and GPU. Ranks themselves always compute where their backend puts them.
    device: str = "auto"
    options: dict = field(default_factory=dict)   # strategy-specific knobs, e.g. {"bucket_mb": 25}
    # The grid (refimpl.mesh): dp = nproc / (replicas x pp x cp x tp).
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    replicas: int = 1                 # independent copies of the layout (tests: group isolation)
    sequence_parallel: bool = False   # with tp > 1: LayerNorm regions split along the sequence
    collectives: str = "torch"        # "refimpl": every collective from refimpl.comm's send/recv
    schedule: str | None = None       # pipeline schedule (pp > 1): gpipe, 1f1b, interleaved, zb-h1
    virtual_stages: int = 1           # model chunks per pipeline rank (interleaved)

    def with_(self, **changes) -> "TrainConfig":
        return replace(self, **changes)

    @property
    def dims(self) -> ParallelDims:
        per_replica = self.replicas * self.pp * self.cp * self.tp
        dp = max(self.nproc // per_replica, 1)
        # The shorthand `--strategy ep` (no --ep): every data-parallel rank in one ep group.
        ep = dp * self.cp if self.strategy == "ep" and self.ep == 1 else self.ep
        return ParallelDims(dp=dp, pp=self.pp, cp=self.cp, tp=self.tp, ep=ep,
                            replica=self.replicas)

    def validate(self) -> None:
        """Constraints every strategy shares; each strategy adds its own in `Strategy.validate`."""
        positive = {"steps": self.steps, "nproc": self.nproc, "global-batch": self.global_batch,
                    "micro-batches": self.micro_batches, "layers": self.model.n_layers,
                    "d-model": self.model.d_model, "heads": self.model.n_heads,
                    "vocab": self.model.vocab_size, "tp": self.tp, "pp": self.pp, "cp": self.cp,
                    "ep": self.ep, "replicas": self.replicas, "virtual-stages": self.virtual_stages}
        for flag, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"--{flag} must be a positive integer (got {value!r})")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise LayoutError(f"--lr must be a finite number > 0 (got {self.lr!r})")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise LayoutError(f"weight decay must be finite and >= 0 (got {self.weight_decay!r})")
        if self.model.n_experts < 0:
            raise LayoutError(f"--experts must be >= 0 (got {self.model.n_experts})")
        if self.global_batch % self.micro_batches:
            raise LayoutError(f"global batch {self.global_batch} must be a positive multiple of "
                              f"--micro-batches {self.micro_batches}")
        if not 1 <= self.seq_len <= self.model.seq_len:
            raise LayoutError(f"--seq-len must be in [1, {self.model.seq_len}] (got {self.seq_len})")
        if self.mixed_precision not in ("fp32", "bf16"):
            raise LayoutError(f"--mixed-precision must be fp32 or bf16 (got {self.mixed_precision})")
        if self.dtype not in DTYPES:
            raise LayoutError(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.dtype == "float64" and self.mixed_precision != "fp32":
            raise LayoutError("--dtype float64 computes in float64: drop --mixed-precision "
                              f"{self.mixed_precision}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise LayoutError(f"device must be auto, cpu or cuda (got {self.device})")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise LayoutError("device cuda asked for, but torch sees no GPU on this machine")
        if self.collectives not in COLLECTIVES:
            raise LayoutError(f"--collectives must be one of {', '.join(COLLECTIVES)} "
                              f"(got {self.collectives!r})")
        per_replica = self.replicas * self.pp * self.cp * self.tp
        if self.nproc % per_replica:
            raise LayoutError(f"--nproc {self.nproc} must be a multiple of pp x cp x tp = "
                              f"{per_replica}" + (f" (x {self.replicas} replicas)"
                                                  if self.replicas > 1 else ""))
        self.dims.validate(self.nproc)
        dp = self.dims.dp
        if self.global_batch % (dp * self.micro_batches):
            raise LayoutError(f"global batch {self.global_batch} must be a multiple of {dp} data-"
                              f"parallel rank(s) x --micro-batches {self.micro_batches} "
                              f"(= {dp * self.micro_batches}): every rank takes equal rows")


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
    def comm(self):
        """The collectives every strategy calls: torch.distributed's, or (--collectives refimpl)
        refimpl.comm's, rebuilt from send/recv with the same signatures and in-place semantics."""
        if self.cfg.collectives == "refimpl":
            import refimpl.comm as comm
            return comm
        import torch.distributed as dist
        return dist

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
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.mixed_precision == "bf16")


@dataclass(frozen=True)
class Option:
    """One strategy knob (`--set key=value`): its default and what values it accepts."""
    default: Any
    kind: type = float                # bool, float, int or str
    choices: tuple = ()
    positive: bool = False

    def check(self, key: str, value) -> None:
        if self.kind is bool and not isinstance(value, bool):
            raise LayoutError(f"--set {key} must be true or false (got {value!r})")
        if self.kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or (self.kind is int and value != int(value)):
                raise LayoutError(f"--set {key} must be a{'n integer' if self.kind is int else ' number'}"
                                  f" (got {value!r})")
            if self.positive and not value > 0:
                raise LayoutError(f"--set {key} must be > 0 (got {value!r})")
        if self.choices and value not in self.choices:
            raise LayoutError(f"--set {key} must be one of {', '.join(map(str, self.choices))} "
                              f"(got {value!r})")


class Strategy(ABC):
    """One way to train the reference model on the grid `ctx.mesh`. See the module docstring.

    `setup` must set `self.model` (this rank's module, reference parameter names) and
    `self.optimizer`. The step is `train_step`; override its parts, not the step."""

    name: str = ""
    min_world_size: int = 1
    max_world_size: int | None = None
    options: dict[str, Option] = {}
    # True: backward runs on loss / W and the gradients are summed (see the module docstring).
    scales_loss_by_world: bool = True
    # A shorthand that puts the whole world on one model-parallel axis: `--strategy tp --nproc 4`
    # is tp = 4 (refimpl.train.resolve_layout), unless that axis was given explicitly.
    whole_world_axis: str | None = None

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.mesh = ctx.mesh
        self.comm = ctx.comm
        self.loss_fn = lm_loss

    # --- layout -----------------------------------------------------------------------------------

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        """Raise LayoutError (one line) if this strategy cannot run `cfg`. Runs before launch."""
        if cfg.nproc < cls.min_world_size:
            raise LayoutError(f"strategy {cls.name!r} needs --nproc >= {cls.min_world_size}")
        if cls.max_world_size is not None and cfg.nproc > cls.max_world_size:
            raise LayoutError(f"strategy {cls.name!r} runs on at most {cls.max_world_size} "
                              f"process(es), got --nproc {cfg.nproc}")
        unknown = set(cfg.options) - set(cls.options)
        if unknown:
            known = ", ".join(sorted(cls.options)) or "none"
            raise LayoutError(f"strategy {cls.name!r} has no option(s) {sorted(unknown)}; "
                              f"known: {known}")
        for key, value in cfg.options.items():
            cls.options[key].check(key, value)

    def option(self, key: str):
        return self.ctx.cfg.options.get(key, self.options[key].default)

    @abstractmethod
    def setup(self, model: GPT) -> None:
        """Place the reference model (built identically on every rank) on this rank."""

    # --- the step: one runner, the same for every strategy -----------------------------------------

    def train_step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step on the global batch; returns the global mean loss as a 0-d tensor
        (equal on every rank). The loop reads it once per step: no sync per micro-batch."""
        if getattr(self.model, "is_pipeline_stage", False):   # pp > 1: a schedule's table
            from refimpl.parallel.pp import pipeline_forward_backward

            local = pipeline_forward_backward(self.model, self.local_micro_batches(batch),
                                              divisor=self.loss_divisor, autocast=self.ctx.autocast,
                                              loss_fn=getattr(self.model, "loss_fn", self.loss_fn))
        else:
            local = forward_backward(self.forward_model, self.local_micro_batches(batch),
                                     loss_fn=self.loss_with_moe_aux, divisor=self.loss_divisor,
                                     micro_step=self.micro_step, autocast=self.ctx.autocast)
        self.sync_gradients()
        with phase("optimizer"):
            self.optimizer_step()
        from refimpl.parallel.moe import update_expert_bias  # (refimpl.parallel imports us)

        update_expert_bias(self.model)     # balance=bias (DeepSeek-V3): after the step; else no-op
        return global_mean_loss(local, self.mesh, self.comm)

    def loss_with_moe_aux(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss, plus the MoE layers' auxiliary load-balancing loss of the forward that made
        `logits` (refimpl.parallel.moe; 0 for a dense model, so its loss is unchanged)."""
        from refimpl.parallel.moe import moe_aux_loss

        # A transform that changes the logits' layout (the vocabulary split over tp) attaches the
        # loss that reads them to the model as `loss_fn`.
        loss_fn = getattr(self.model, "loss_fn", self.loss_fn)
        return loss_fn(logits, targets) + moe_aux_loss(self.model)

    @property
    def forward_model(self) -> nn.Module:
        """What the runner calls (a wrapper such as DDP's, or the model itself)."""
        return self.model

    def local_micro_batches(self, batch: Batch) -> list[Batch]:
        """This rank's rows of the global batch -- rows [i·B/dp, (i+1)·B/dp) for dp index i (tp
        and pp peers take the same rows) -- cut into `cfg.micro_batches` micro-batches."""
        rows = batch.shard(self.mesh.index("dp"), self.mesh.size("dp")).to(self.ctx.device)
        if self.mesh.size("cp") > 1:   # context parallel: this rank's chunks of every sequence
            from refimpl.parallel.cp_model import shard_batch
            rows = shard_batch(rows, self.mesh.index("cp"), self.mesh.size("cp"))
        return rows.micro_batches(self.ctx.cfg.micro_batches)

    @property
    def loss_divisor(self) -> int:
        """W: backward runs on loss / W, gradients are summed over the dp x cp ranks (module
        docstring). A division, not a multiplication by 1/W: 1/3 would round once more."""
        return self.mesh.size("dp_cp") if self.scales_loss_by_world else 1

    def micro_step(self, is_last: bool):
        """Context around each micro-batch's forward and backward: where a strategy says whether
        this backward's gradients are communicated (only the last's: gradient accumulation)."""
        return contextlib.nullcontext()

    def sync_gradients(self) -> None:
        """After every backward of the step: finish the data-parallel gradient sync."""

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    # --- gathering and accounting ---------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The reference model's full state dict (reference names, full shapes, on CPU).

        Collective: every rank must call it. Every rank returns the same dict. The default
        reassembles the model's tensors from the placement each one records
        (refimpl.parallel.placement): a replicated model is already whole."""
        from refimpl.parallel.placement import gather_full_state_dict

        return gather_full_state_dict(self.model.state_dict(), self.model, self.mesh, self.comm)

    @abstractmethod
    def model_state(self) -> ModelStateBytes:
        """Bytes of parameters, gradients and optimizer states this rank holds right now."""

    def activation_exclusions(self) -> list[torch.Tensor]:
        """Tensors that autograd saves but that are model state, not activations: Linear's
        backward saves weight.t(), a view that is not a Parameter (~5 MB here), and ZeRO-3
        saves views of its gathered parameters. The activation tracker leaves them out."""
        return list(self.model.parameters())


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The one optimizer every strategy uses: AdamW, so the arithmetic has m and v.

    foreach=False: the per-tensor path does the same arithmetic in the same order as our
    from-scratch sharded optimizers, which keeps equivalence at fp32 round-off.
    """
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
