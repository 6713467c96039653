"""The gradient a pipeline stage sends back, and the seed's sketch that sends the wrong one; and
the sketch's layer split (`sketch_split`), beside refimpl.parallel.pp.stage.partition.

Seed 000 (§3.4's code sketch) ends the last stage's step with `grad_to_send = output_activations.grad`.
That is not what the previous stage needs, and it is not even there: `output_activations` is the
result of this stage's layers, a non-leaf tensor, so autograd keeps no `.grad` on it (None, with a
warning). What stage s−1 waits for is the gradient of the loss with respect to the activation it
*sent*, i.e. this stage's input. The fix, as refimpl.parallel.pp.runner does: make the received
tensor a leaf that requires grad (`x = recv(...).requires_grad_()`), run the stage, backpropagate,
and send `x.grad` (or `torch.autograd.grad(out, [x], grad)`).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn


def sketch_gradient(stage: nn.Module, received: torch.Tensor, loss_fn) -> torch.Tensor | None:
    """The seed's last stage: the gradient it reads is `output_activations.grad`."""
    activations = received.detach()                      # what recv_tensor returns: a plain tensor
    output_activations = stage(activations)
    loss_fn(output_activations).backward()
    with warnings.catch_warnings():                      # torch warns that a non-leaf has no .grad
        warnings.simplefilter("ignore")
        return output_activations.grad


def fixed_gradient(stage: nn.Module, received: torch.Tensor, loss_fn) -> torch.Tensor:
    """The runner's way: the received activation is a leaf that requires grad; send its .grad."""
    x = received.detach().requires_grad_()
    loss_fn(stage(x)).backward()
    return x.grad


def reference_gradient(first: nn.Module, last: nn.Module, inputs: torch.Tensor, loss_fn) -> torch.Tensor:
    """d loss / d (first stage's output) in one process: what the previous stage must receive."""
    boundary = first(inputs)
    (grad,) = torch.autograd.grad(loss_fn(last(boundary)), [boundary])
    return grad


def sketch_split(n_layers: int, stages: int) -> list[range]:
    """The layers each stage gets in the seed's sketch (§3.4): `n_layers // stages` each, and the
    last stage runs to `len(model_layers)`, so it takes the whole remainder as well."""
    per_stage = n_layers // stages
    return [range(s * per_stage, n_layers if s == stages - 1 else (s + 1) * per_stage)
            for s in range(stages)]
