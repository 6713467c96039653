"""Zero bubble's split of the backward (Qi et al. 2023): B the input gradient, W the weights'.

F records each layer's input X and B its output gradient dY; W computes dA = dY^T X later.
"""
from __future__ import annotations

import functools
from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from refimpl.model.layers import WatchedLinear, linear_weight_grads
from refimpl.model.rmsnorm import RMSNorm

# The layers W has a formula for; any other trainable parameter is refused (`weight_layers`).
WEIGHT_LAYERS = (nn.Linear, nn.LayerNorm, RMSNorm, nn.Embedding)


class WeightGradRecord:
    """The [module, X, dY] entries of one micro-batch on one chunk, filled during F and B."""

    def __init__(self):
        self.entries: list[list] = []

    def apply(self) -> None:
        """W: each layer's weight gradients into .grad through autograd's accumulator (so what dp
        hooked on a parameter runs as after a plain backward)."""
        for module, grads in self.gradients():
            torch.autograd.backward(parameters(module), grads)
        self.entries.clear()

    def gradients(self):
        """(layer, its weight gradients), last layer first; a layer run twice once, summed."""
        live = [(m, x, dy) for m, x, dy in self.entries if dy is not None]
        uses, summed = Counter(id(m) for m, _, _ in live), {}
        for module, x, dy in reversed(live):
            grads = weight_grads(module, x, dy)
            if id(module) in summed:
                grads = [a + b for a, b in zip(summed.pop(id(module)), grads)]
            uses[id(module)] -= 1
            if uses[id(module)]:
                summed[id(module)] = grads
            else:
                yield module, grads


def parameters(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]


def weight_layers(chunk: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of `chunk` that W covers; raises if a trainable parameter is in none of them."""
    layers = [(name, m) for name, m in chunk.named_modules()
              if isinstance(m, (*WEIGHT_LAYERS, WatchedLinear))]
    covered = {id(p) for _, m in layers for p in m.parameters(recurse=False)}
    for name, p in chunk.named_parameters():
        if p.requires_grad and id(p) not in covered:
            owner = chunk.get_submodule(name.rpartition(".")[0])
            raise ValueError(f"zero bubble's W has no weight-gradient formula for {name} "
                             f"({type(owner).__name__}): add one to weight_grads")
    return layers


def _keep(entry: list, grad: torch.Tensor) -> None:
    """B reached the layer's output: its gradient into entry[2] (summed if it arrives in parts)."""
    entry[2] = grad if entry[2] is None else entry[2] + grad


@contextmanager
def record_weight_grads(chunk: nn.Module, record: WeightGradRecord, layers: list | None = None):
    """Fill `record` during one forward of `chunk` (`layers`: its `weight_layers`). Yields the
    (entry, embedding output) pairs whose gradient B stores in entry[2] itself."""
    layers, kept = weight_layers(chunk) if layers is None else layers, []

    def watch(module, x, y):
        entry = [module, x.detach(), None]
        record.entries.append(entry)
        if isinstance(module, nn.Embedding):
            kept.append((entry, y))
        else:
            y.register_hook(functools.partial(_keep, entry))

    watched = [m for _, m in layers if isinstance(m, WatchedLinear)]
    handles = [m.register_forward_hook(lambda m, inputs, y: watch(m, inputs[0], y))
               for _, m in layers if not isinstance(m, WatchedLinear)]
    for m in watched:
        m.watch_matmul(watch)
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()
        for m in watched:
            m.watch_matmul(None)


def weight_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """dA (and the bias's) from the layer's input X and output gradient dY, in the master dtype."""
    dtype = module.weight.dtype
    dy = dy.to(dtype)
    x = x if isinstance(module, nn.Embedding) else x.to(dtype)
    with torch.no_grad():
        if isinstance(module, WatchedLinear):
            return module.weight_grads(x, dy)
        if isinstance(module, nn.Linear):
            return linear_weight_grads(x, dy, module.bias is not None)
        if isinstance(module, nn.LayerNorm):
            x_hat = F.layer_norm(x, module.normalized_shape, eps=module.eps)        # recomputed
            dims = tuple(range(dy.dim() - len(module.normalized_shape)))
            return [(dy * x_hat).sum(dims), dy.sum(dims)]
        if isinstance(module, RMSNorm):                                              # dg = sum dY x_hat
            return [(dy * module.normalized(x)).reshape(-1, dy.shape[-1]).sum(0)]
        table = torch.zeros(module.weight.shape, dtype=dtype, device=dy.device)    # nn.Embedding
        return [table.index_add_(0, x.reshape(-1), dy.reshape(-1, dy.shape[-1]))]
