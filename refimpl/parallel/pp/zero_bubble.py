"""Zero bubble's split of the backward (Qi et al. 2023): B the input gradient, W the weights'.

F records each layer's input X and B its output gradient dY; W computes dA = dY^T X later.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from refimpl.model.layers import WatchedLinear
from refimpl.model.moe import MoEMLP
from refimpl.model.rmsnorm import RMSNorm
from refimpl.placement import is_resharded

# The layers W has a formula for; any other trainable parameter is refused (`_check_covered`).
WEIGHT_LAYERS = (nn.Linear, nn.LayerNorm, RMSNorm, nn.Embedding)


class WeightGradRecord:
    """The [module, X, dY] entries of one micro-batch on one chunk, filled during F and B."""

    def __init__(self):
        self.entries: list[list] = []
        self.block_of: dict[int, str] = {}   # id(module) -> its block ("blocks.3", "lm_head")
        self.whole: list = []                # the first piece: [(its output, [.., .., dY])]

    def apply(self) -> None:
        """W: the weight gradients into .grad, last block first, a layer run twice summed first;
        one autograd call per block."""
        for out, entry in self.whole:
            torch.autograd.backward(out, entry[2])
        self.whole.clear()
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


@dataclass(frozen=True)
class ChunkLayers:
    """What `record_weight_grads` hooks on a chunk (found once per step)."""
    hooked: tuple          # layers of WEIGHT_LAYERS, each given a forward hook
    watched: tuple         # tensor-parallel linears, which report their matmul
    block_of: dict         # id(module) -> its block
    plain: bool            # no experts and no ZeRO-3/FSDP unit: may take a plain backward
    whole: bool            # the first piece, whose W is the whole backward


def chunk_layers(chunk: nn.Module) -> ChunkLayers:
    """The layers of `chunk` that W covers; raises if a trainable parameter is in none of them."""
    layers = [(name, m) for name, m in chunk.named_modules()
              if isinstance(m, (*WEIGHT_LAYERS, WatchedLinear))]
    _check_covered(chunk, [m for _, m in layers])
    plain = (not any(isinstance(m, MoEMLP) for m in chunk.modules())
             and not any(is_resharded(p) for p in chunk.parameters()))
    return ChunkLayers(hooked=tuple(m for _, m in layers if not isinstance(m, WatchedLinear)),
                       watched=tuple(m for _, m in layers if isinstance(m, WatchedLinear)),
                       block_of={id(m): ".".join(name.split(".")[:2]) for name, m in layers},
                       plain=plain, whole=plain and any(isinstance(m, nn.Embedding) for _, m in layers))


def _keep(entry: list, y: torch.Tensor) -> None:
    """Store Y's gradient in entry[2] when B reaches it (summed if it arrives in parts)."""
    def keep(grad):
        entry[2] = grad if entry[2] is None else entry[2] + grad
    y.register_hook(keep)


@contextmanager
def record_weight_grads(chunk: nn.Module, record: WeightGradRecord, layers: ChunkLayers | None = None):
    """Fill `record` during one forward of `chunk`. Yields the (entry, tensor) pairs whose gradient
    B stores in entry[2]: the embeddings' outputs, or the output of a first piece whose W is whole."""
    layers = chunk_layers(chunk) if layers is None else layers
    kept, outputs = [], []

    def hook(module, inputs, output):
        entry = [module, inputs[0].detach(), None]
        record.entries.append(entry)
        if isinstance(module, nn.Embedding):
            kept.append((entry, output))       # B hands their dY over itself
        else:
            _keep(entry, output)

    def watch(module, x, y):
        entry = [module, x.detach(), None]
        record.entries.append(entry)
        _keep(entry, y)

    record.block_of = layers.block_of
    if layers.whole:
        handles = [chunk.register_forward_hook(lambda m, i, output: outputs.append(output))]
    else:
        handles = [m.register_forward_hook(hook) for m in layers.hooked]
        for m in layers.watched:
            m.watch_matmul(watch)
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()
        for m in layers.watched if not layers.whole else ():
            m.watch_matmul(None)
    if outputs:
        entry = [chunk, None, None]
        record.whole.append((outputs[-1], entry))
        kept.append((entry, outputs[-1]))


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
