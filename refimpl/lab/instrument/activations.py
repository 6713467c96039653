"""Activation bytes measured on a live model: the peak of what autograd saves for backward
(refimpl.memory.ActivationTracker), beside the arithmetic of refimpl.memory."""
from __future__ import annotations

import torch

from refimpl.memory import ActivationTracker
from refimpl.model import lm_loss


def measure_block_activations(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Peak bytes saved for backward by one forward of `block` on input `x` (parameters excluded)."""
    x = x.detach().requires_grad_()
    with ActivationTracker(exclude=block.parameters()) as tracker:
        block(x)
    return tracker.peak


def measure_step_activations(model: torch.nn.Module, inputs: torch.Tensor,
                             targets: torch.Tensor) -> int:
    """Peak bytes saved for backward over a whole forward + backward of the model and its loss."""
    with ActivationTracker(exclude=model.parameters()) as tracker:
        lm_loss(model(inputs), targets).backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak
