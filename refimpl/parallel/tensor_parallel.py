"""`tp`: the whole world on the tensor-parallel axis (seed §3.3; Megatron-LM).

Every rank holds 1/t of every weight matrix (refimpl.parallel.tp_model.parallelize_tp) and sees
*all* rows of the global batch: tensor parallelism splits the model, not the data. Forward and
backward communicate inside every block (2 all-reduces per block per pass, or all-gather +
reduce-scatter with `sequence_parallel`); the optimizer then updates each rank's slices with
no further communication, because every slice's gradient is already complete on its owner
(replicated parameters -- LayerNorms, row biases, positions -- hold equal gradients on every rank,
or are summed in backward under sequence parallelism).

The loss is the vocabulary-parallel cross-entropy (refimpl.parallel.tp_vocab): the same value on
every rank, since it is built from all-reduced per-token numbers; no extra reduction is needed.

Options: sequence_parallel (false).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from refimpl.memory import ModelStateBytes, measured_model_state
from refimpl.model import Batch, GPT
from refimpl.parallel.tp_model import gather_tp_state_dict, parallelize_tp, tp_layout_problem, tp_lm_loss
from refimpl.strategy import LayoutError, Strategy, TrainConfig, make_optimizer
from refimpl.trace.profiling import phase

OPTIONS = {"sequence_parallel": False}


def validate_tp(cfg: TrainConfig, tp: int, name: str) -> None:
    """The tp layout checks both `tp` and `torch-tp` share (one line each, before launch)."""
    unknown = set(cfg.options) - set(OPTIONS)
    if unknown:
        raise LayoutError(f"strategy {name!r} has no option(s) {sorted(unknown)}; known: "
                          f"{', '.join(OPTIONS)}")
    problem = tp_layout_problem(cfg.model, tp, cfg.seq_len,
                                bool(cfg.options.get("sequence_parallel", False)))
    if problem:
        raise LayoutError(problem)


class TensorParallel(Strategy):
    name = "tp"

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)
        validate_tp(cfg, cfg.nproc, cls.name)

    def setup(self, model: GPT) -> None:
        ctx = self.ctx
        self.group = dist.new_group(list(range(ctx.world_size))) if ctx.world_size > 1 else None
        sp = bool(ctx.cfg.options.get("sequence_parallel", False))
        self.model = parallelize_tp(model.to(ctx.device), self.group, sequence_parallel=sp)
        self.optimizer = make_optimizer(self.model.parameters(), ctx.cfg)

    def train_step(self, batch: Batch) -> float:
        micro = batch.to(self.ctx.device).micro_batches(self.ctx.cfg.micro_batches)
        total = 0.0
        for mb in micro:
            with phase("forward"), self.ctx.autocast():
                loss = tp_lm_loss(self.model, self.model(mb.inputs), mb.targets) / len(micro)
            with phase("backward"):
                loss.backward()
            total += loss.item()
        with phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return gather_tp_state_dict(self.model, self.group)

    def activation_exclusions(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def model_state(self) -> ModelStateBytes:
        return measured_model_state(self.model.parameters(), self.optimizer)
