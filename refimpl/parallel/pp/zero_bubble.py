"""Zero bubble's split of the backward (Qi et al. 2023): B the input gradient, W the weights'.

F records each layer's input X and B its output gradient dY; W computes dA = dY^T X later.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from refimpl.model.layers import WatchedLinear
from refimpl.model.rmsnorm import RMSNorm

# The layers W has a formula for; any other trainable parameter is refused (`_check_covered`).
WEIGHT_LAYERS = (nn.Linear, nn.LayerNorm, RMSNorm, nn.Embedding)


class WeightGradRecord:
    """The [module, X, dY] entries of one micro-batch on one chunk, filled during F and B."""

    def __init__(self):
        self.entries: list[list] = []
        self.block_of: dict[int, str] = {}   # id(module) -> its block ("blocks.3", "lm_head")

    def apply(self) -> None:
        """W: the weight gradients into .grad, last block first, a layer run twice summed first;
        one autograd call per block."""
        live = [(m, x, dy) for m, x, dy in self.entries if dy is not None]
        first_use = {}
        for i, (module, _, _) in enumerate(live):
            first_use.setdefault(id(module), i)
        summed, params, grads_in, block = {}, [], [], None
        for i in reversed(range(len(live))):
            module, x, dy = live[i]
            grads = weight_grads(module, x, dy)
            if id(module) in summed:
                grads = [a + b for a, b in zip(summed.pop(id(module)), grads)]
            if i > first_use[id(module)]:
                summed[id(module)] = grads
                continue
            if self.block_of.get(id(module)) != block and params:
                torch.autograd.backward(params, grads_in)   # AccumulateGrad: .grad += g, and its hooks
                params, grads_in = [], []
            block = self.block_of.get(id(module))
            params += [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]
            grads_in += grads
        if params:
            torch.autograd.backward(params, grads_in)
        self.entries.clear()


def weight_layers(chunk: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of `chunk` that W covers; raises if a trainable parameter is in none of them."""
    layers = [(name, m) for name, m in chunk.named_modules()
              if isinstance(m, (*WEIGHT_LAYERS, WatchedLinear))]
    _check_covered(chunk, [m for _, m in layers])
    return layers


def _keep(entry: list, y: torch.Tensor) -> None:
    """Store Y's gradient in entry[2] when B reaches it (summed if it arrives in parts)."""
    def keep(grad):
        entry[2] = grad if entry[2] is None else entry[2] + grad
    y.register_hook(keep)


@contextmanager
def record_weight_grads(chunk: nn.Module, record: WeightGradRecord):
    """Fill `record` during one forward of `chunk`. Yields the (entry, embedding output) pairs
    whose gradient B stores in entry[2] itself."""
    layers, kept = weight_layers(chunk), []

    def hook(module, inputs, output):
        entry = [module, inputs[0].detach(), None]
        record.entries.append(entry)
        if isinstance(module, nn.Embedding):
            kept.append((entry, output))
        else:
            _keep(entry, output)

    def watch(module, x, y):
        entry = [module, x.detach(), None]
        record.entries.append(entry)
        _keep(entry, y)

    record.block_of = {id(m): ".".join(name.split(".")[:2]) for name, m in layers}
    watched = [m for _, m in layers if isinstance(m, WatchedLinear)]
    handles = [m.register_forward_hook(hook) for _, m in layers if not isinstance(m, WatchedLinear)]
    for m in watched:
        m.watch_matmul(watch)
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()
        for m in watched:
            m.watch_matmul(None)


def _check_covered(chunk: nn.Module, layers: list[nn.Module]) -> None:
    covered = {id(p) for m in layers for p in m.parameters(recurse=False)}
    for name, p in chunk.named_parameters():
        if p.requires_grad and id(p) not in covered:
            owner = chunk.get_submodule(name.rpartition(".")[0]) if "." in name else chunk
            raise ValueError(f"zero bubble's W has no weight-gradient formula for {name} "
                             f"({type(owner).__name__}): add one to weight_grads")


def weight_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """dA (and the bias's) from the layer's input X and output gradient dY, in the master dtype."""
    dtype = module.weight.dtype
    dy = dy.to(dtype)
    x = x if isinstance(module, nn.Embedding) else x.to(dtype)
    with torch.no_grad():
        if isinstance(module, WatchedLinear):
            return module.weight_grads(x, dy)
        if isinstance(module, nn.Linear):
            dy2 = dy.reshape(-1, dy.shape[-1])
            grads = [dy2.t() @ x.reshape(-1, x.shape[-1])]                          # dA = dY^T X
            return grads + ([dy2.sum(0)] if module.bias is not None else [])
        if isinstance(module, nn.LayerNorm):
            x_hat = F.layer_norm(x, module.normalized_shape, eps=module.eps)        # recomputed
            dims = tuple(range(dy.dim() - len(module.normalized_shape)))
            return [(dy * x_hat).sum(dims), dy.sum(dims)]
        if isinstance(module, RMSNorm):     # dg = sum dY x_hat, x_hat as the forward computes it
            wide = x.to(torch.promote_types(x.dtype, torch.float32))
            x_hat = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + module.eps)).to(dtype)
            return [(dy * x_hat).reshape(-1, dy.shape[-1]).sum(0)]
        table = torch.zeros(module.weight.shape, dtype=dtype, device=dy.device)    # nn.Embedding
        return [table.index_add_(0, x.reshape(-1), dy.reshape(-1, dy.shape[-1]))]
