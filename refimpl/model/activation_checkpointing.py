"""Activation checkpointing (a.k.a. gradient checkpointing), one transformer block at a time.

Instead of keeping every intermediate of a block for backward, keep only the block's input and
recompute the block's forward during backward (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"). Cost: one extra forward per block. Saving: per layer, the s·b·h·(34 + 5as/h) of
Korthikanti et al. 2022 shrinks to the 2·s·b·h of the block input ("full" recompute).

(Not to be confused with saving a training state to disk: that is `--save-state`.)
"""
from __future__ import annotations

import torch.nn as nn

from refimpl.model.gpt import Block


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Checkpoint every block of a GPT in place; returns the model.

    The block itself recomputes (`Block.recompute`, see refimpl.model.gpt), so parameter names,
    state-dict keys and the module tree stay those of the reference, and any transform applied
    before or after (tensor parallel, a pipeline split, FSDP2's wrapping) keeps it."""
    for block in model.modules():
        if isinstance(block, Block):
            block.recompute = True
    return model
