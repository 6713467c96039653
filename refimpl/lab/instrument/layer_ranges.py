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
_LABELLED: weakref.WeakSet = weakref.WeakSet()     # a module is labelled once


def around_forward(module: nn.Module, context) -> None:
    """`context()` entered before each forward of `module` and exited after it, also after one that
    raised (a stack: a module may run again while it runs, as activation checkpointing recomputes).
    Hooks, not a wrapping module: the module and its name stay as they are."""
    entered = []

    def enter(m, args):
        entered.append(context())
        entered[-1].__enter__()

    def leave(m, args, output):
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def label_layers(model: nn.Module, prefix: str = "tp:") -> nn.Module:
    """Every tensor-parallel layer of `model` opens `prefix + its name` around its forward (in place)."""
    for name, module in model.named_modules():
        if isinstance(module, LAYERS) and module not in _LABELLED:
            _LABELLED.add(module)
            around_forward(module, partial(phase, prefix + name))
    return model
