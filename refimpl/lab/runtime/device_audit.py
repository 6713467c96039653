"""Tensors refimpl creates without saying where: the CUDA failure mode, found on a CPU.

On a GPU server a rank computes on cuda:k while torch's default device stays the CPU, so a factory
call in our code without `device=` (torch.zeros(n), torch.tensor(x), ...) makes a CPU tensor that
NCCL refuses, or that the next kernel has to copy over. CI has no GPU, so the rule is checked where
it would break: under REFIMPL_DEVICE_AUDIT=<folder> every rank runs inside `FactoryAudit`, which
notes each factory call made without a device from a refimpl source line, and writes them to
<folder>/rank<r>.json (tests/test_nccl_rules.py). Calls that take the device from a tensor
(zeros_like, new_zeros, .to) are fine and not intercepted.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor,
             torch.arange, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye,
             torch.linspace}
PACKAGE = Path(__file__).resolve().parents[2]     # refimpl/
HERE = str(Path(__file__).resolve())


class FactoryAudit(TorchFunctionMode):
    """Counts, by refimpl source line, the factory calls made with no device."""

    def __init__(self):
        super().__init__()
        self.found: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = _refimpl_caller()
            if where is not None:
                self.found[f"{where} {func.__name__}"] += 1
        return func(*args, **kwargs)

    def write(self, folder: str | Path, rank: int) -> None:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(dict(self.found), indent=1))


def _refimpl_caller() -> str | None:
    """"path:line function" of the innermost caller outside torch, if it is a refimpl source."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == HERE
                                 or "/torch/" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename).resolve()
    if PACKAGE not in path.parents:
        return None
    return f"{path.relative_to(PACKAGE.parent)}:{frame.f_lineno} {frame.f_code.co_name}"
