"""Activation checkpointing (a.k.a. gradient checkpointing), one transformer block at a time."""
from __future__ import annotations

import torch.nn as nn

from refimpl.model.gpt import Block


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Checkpoint every block of a GPT in place; returns the model."""
    for block in model.modules():
        if isinstance(block, Block):
            block.recompute = True
    return model
