"""Each tensor-parallel layer's forward inside a range named after its place in the model
(`tp:blocks.3.attn`, `tp:blocks.3.mlp`, `tp:blocks.3.mlp.experts.0`), so a trace says which layer a
forward collective belongs to. The lab's loop attaches them from the module names (refimpl.lab.loop):
the layers themselves carry no label."""
from __future__ import annotations

import weakref
from functools import partial

import torch.nn as nn

from refimpl.parallel.tp.attention import ParallelSelfAttention
from refimpl.parallel.tp.blocks import ParallelMLP, ParallelSwiGLU
from refimpl.seam import phase

LAYERS = (ParallelSelfAttention, ParallelMLP, ParallelSwiGLU)

# module -> the ranges its forward has open (a stack: a layer may run inside itself, or again while
# activation checkpointing recomputes it); a module already labelled is not labelled twice
_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def label_layers(model: nn.Module, prefix: str = "tp:") -> nn.Module:
    """Every tensor-parallel layer of `model` opens `prefix + its name` around its forward (in place)."""
    for name, module in model.named_modules():
        if isinstance(module, LAYERS) and module not in _OPEN:
            _OPEN[module] = []
            module.register_forward_pre_hook(partial(_open, prefix + name))
            module.register_forward_hook(_close)
    return model


def _open(name: str, module: nn.Module, args) -> None:
    span = phase(name)
    span.__enter__()
    _OPEN[module].append(span)


def _close(module: nn.Module, args, out) -> None:
    _OPEN[module].pop().__exit__(None, None, None)
