"""What every PyTorch twin shares, and the traits only a twin has.

A twin is PyTorch's own implementation of one of our strategies, run through the same loop
(refimpl.train) as the comparator. It differs from ours in three ways the core does not need to
know about, so they live here:

  * PyTorch's wrappers (DDP, FSDP2, the pipelining schedules) divide the summed gradients by the
    world size themselves (Li et al. 2020, §4.2): the loss is not scaled by 1/W (`loss_divisor`);
  * the DTensor twins (torch-tp, torch-fsdp2-tp) parallelize the plain reference themselves:
    they are handed it untouched instead of our transforms' result (`takes_our_transforms`);
  * those whose state is DTensors or replicas checkpoint through torch.distributed.checkpoint
    (refimpl.lab.checkpoint.dcp_checkpoint), not refimpl's sharded format (`through_dcp`).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from refimpl.lab.checkpoint.gather import full_state_items, gather_full_state_dict
from refimpl.lab.instrument.state_bytes import measured_model_state
from refimpl.memory import ModelStateBytes
from refimpl.rank_model import RankModel
from refimpl.strategy import Strategy


class TorchTwin(Strategy):
    """A strategy PyTorch implements. The twins set the traits below."""

    # PyTorch's DDP, ZeroRedundancyOptimizer and fully_shard sum every gradient over dp x cp and
    # run no pipeline table: a twin that does (torch-pp-*, torch-fsdp2-tp) says so
    experts_over_edp: bool = False
    on_a_pipeline: bool = False

    # False: DTensor's parallelize_module runs on the plain reference (not our tp/cp/ep shards)
    takes_our_transforms: bool = True
    # True: --checkpoint-dir saves and resumes it through torch.distributed.checkpoint
    checkpoints_through_dcp: bool = False

    def transform(self, reference: nn.Module, transforms) -> RankModel:
        if self.takes_our_transforms:
            return super().transform(reference, transforms)
        return RankModel(reference)

    @property
    def loss_divisor(self) -> int:
        return 1          # PyTorch divides the summed gradients by W itself

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The reference model's full state dict on every rank (refimpl.lab.checkpoint.full_state)."""
        return gather_full_state_dict(self.model.state_dict(), self.model, self.mesh)

    def model_state(self) -> ModelStateBytes:
        """Bytes of parameters, gradients and optimizer states this rank holds now
        (refimpl.lab.instrument.model_state); the default counts the model's and the optimizer's."""
        return measured_model_state(self.model.parameters(), self.optimizer)

    def activation_exclusions(self) -> list[torch.Tensor]:
        """The model's tensors autograd saves (refimpl.lab.instrument.activations)."""
        return list(self.model.parameters())

    def state_items(self):
        """(reference name, full tensor) of this rank's pipeline stage, one gathered at a time,
        in the same order on every rank of the stage (--save-state: refimpl.lab.checkpoint.export)."""
        return full_state_items(self.model.state_dict(), self.model, self.mesh)


def through_dcp(strategy_cls: type[Strategy]) -> bool:
    """Whether `strategy_cls` checkpoints through torch.distributed.checkpoint (a twin that says so)."""
    return issubclass(strategy_cls, TorchTwin) and strategy_cls.checkpoints_through_dcp


def on_our_transforms(strategy_cls: type[Strategy]) -> bool:
    """Whether `strategy_cls` runs on our model-parallel transforms' shards (every strategy of
    ours; a twin unless it parallelizes the plain reference itself)."""
    return not issubclass(strategy_cls, TorchTwin) or strategy_cls.takes_our_transforms
