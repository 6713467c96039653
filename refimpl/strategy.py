"""What a parallelism strategy is: placement (`setup`) plus synchronisation (`micro_step`,
`sync_gradients`, `optimizer_step`), around one step runner. Each rank's loss is divided by W and the
gradients summed: DDP's sum-then-divide (Li et al. 2020, §4.2), rounded once (docs/core_notes.md)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from refimpl.config import Option, RunContext, TrainConfig
from refimpl.model import Batch
from refimpl.rank_model import RankModel
from refimpl.seam import phase
from refimpl.step import forward_backward, global_mean_loss


class Strategy:
    """One way to train the reference model on the grid `ctx.mesh`. See the module docstring."""

    name: str = ""
    min_world_size: int = 1
    max_world_size: int | None = None
    options: dict[str, Option] = {}
    # What it composes with (checked before launch: refimpl.lab.layout_rules): --ep > 1, summing an
    # expert's gradient over "edp", not other experts' ranks; --pp > 1, a stage's table and sync.
    experts_over_edp: bool = True
    on_a_pipeline: bool = True

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.mesh = ctx.mesh

    # --- layout -----------------------------------------------------------------------------------

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        """Raise LayoutError (one line) if this strategy cannot run `cfg`. Runs before launch, after
        the shared rules (refimpl.lab.layout_rules: --nproc within the sizes above, the options)."""

    def option(self, key: str):
        return self.ctx.cfg.options.get(key, self.options[key].default)

    def transform(self, reference: nn.Module, transforms) -> RankModel:
        """This rank's share of the reference: the model-parallel `transforms` in their order
        (refimpl.compose.transforms.model_parallel), whose result `place` then places."""
        return transforms(reference, self.ctx)

    def place(self, rank_model: RankModel) -> None:
        """`setup` the module the transforms handed over; keep the rank model the step runs."""
        self.setup(rank_model.module)
        self.rank_model = self.step_model(rank_model)

    def setup(self, model: nn.Module) -> None:
        """Place this rank's model (the same transformed reference on every rank of the dp axis).
        The default replicates it: the whole module here, one AdamW over its parameters."""
        self.model = model
        self.optimizer = make_optimizer(model.parameters(), self.ctx.cfg)

    def step_model(self, rank_model: RankModel) -> RankModel:
        """What the step runner runs, after `setup`: the transforms' rank model, or a new one
        where this strategy runs the model its own way."""
        return rank_model

    # --- the step: one runner, the same for every strategy -----------------------------------------

    def train_step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step on the global batch; returns the global mean loss as a 0-d tensor
        (equal on every rank). The loop reads it once per step: no sync per micro-batch."""
        rank_model, micro = self.rank_model, self.local_micro_batches(batch)
        if rank_model.pipeline is not None:   # pp > 1: a schedule's table
            local = rank_model.pipeline.run(micro, divisor=self.loss_divisor,
                                            autocast=self.ctx.autocast, loss_fn=rank_model.loss_fn)
        else:
            local = forward_backward(self.forward_model, micro, loss_fn=self.loss_with_moe_aux,
                                     divisor=self.loss_divisor, micro_step=self.micro_step,
                                     autocast=self.ctx.autocast)
        self.sync_gradients()
        with phase("optimizer"):
            self.optimizer_step()
        rank_model.after_step()     # balance=bias (DeepSeek-V3): after the step; else no-op
        return global_mean_loss(local, self.mesh, rank_model.pipeline)

    def loss_with_moe_aux(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss plus the MoE layers' load-balancing loss of this forward (0 for a dense model)."""
        return self.rank_model.loss_fn(logits, targets) + self.rank_model.aux_loss()

    @property
    def forward_model(self) -> nn.Module:
        """What the runner calls (a wrapper such as DDP's, or the model itself)."""
        return self.model

    def local_micro_batches(self, batch: Batch) -> list[Batch]:
        """This rank's rows of the global batch -- rows [i·B/dp, (i+1)·B/dp) for dp index i (tp
        and pp peers take the same rows) -- cut into `cfg.micro_batches` micro-batches."""
        rows = batch.shard(self.mesh.index("dp"), self.mesh.size("dp")).to(self.ctx.device)
        if self.rank_model.shard_batch is not None:   # cp: this rank's chunks of every sequence
            rows = self.rank_model.shard_batch(rows)
        return rows.micro_batches(self.ctx.cfg.micro_batches)

    @property
    def loss_divisor(self) -> int:
        """W: backward runs on loss / W, gradients are summed over the dp x cp ranks (module
        docstring). A division, not a multiplication by 1/W: 1/3 would round once more."""
        return self.mesh.size("dp_cp")

    def micro_step(self, is_last: bool):
        """Context around each micro-batch's forward and backward: where a strategy says whether
        this backward's gradients are communicated (only the last's: gradient accumulation)."""
        return contextlib.nullcontext()

    def sync_gradients(self) -> None:
        """After every backward of the step: finish the data-parallel gradient sync."""

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)


def optimizer_settings(cfg: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    """The one optimizer every strategy uses: AdamW (the arithmetic's m and v)."""
    return torch.optim.AdamW, {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "foreach": False}


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    cls, settings = optimizer_settings(cfg)
    return cls(params, **settings)
