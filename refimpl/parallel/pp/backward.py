"""B and W, as the runner runs them: one whole backward, or zero bubble's split (Qi et al. 2023).

    split = SplitBackward(chunks, row) if the row has W's else WholeBackward()
    with split.recording(a, chunk) as kept: out = chunk(x)       # F
    dx = split.backward(a, out, grad, x, kept)                   # B: dx only, when split
    split.weights(a)                                             # W: the weights' gradients
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from refimpl.parallel.pp.actions import Action
from refimpl.parallel.pp.zero_bubble import WeightGradRecord, chunk_layers, record_weight_grads


class WholeBackward:
    """B of a table without W: the whole backward."""

    def recording(self, a: Action, chunk):
        return nullcontext([])

    def backward(self, a: Action, out, grad, x, kept):
        torch.autograd.backward(out, grad)
        return None if x is None else x.grad

    def weights(self, a: Action) -> None:
        pass


def whole_backwards(entries: list, plain: list[bool]) -> frozenset:
    """The (micro-batch, chunk) whose B is followed at once by its own W in this row, on a chunk
    that may take a plain backward: nothing can run between them, so one plain backward does both
    (PyTorch's pipelining merges such a pair too)."""
    whole = set()
    for entry, after in zip(entries, entries[1:]):
        b = entry[-1]               # an overlapped pair (F&B) runs its B last
        if len(after) == 1 and (b.kind, after[0].kind) == ("B", "W"):
            w = after[0]
            if (b.micro_batch, b.chunk) == (w.micro_batch, w.chunk) and plain[b.chunk]:
                whole.add((b.micro_batch, b.chunk))
    return frozenset(whole)


class SplitBackward:
    """The runner's B and W under a split table: B the input gradient only, W the weights'."""

    def __init__(self, chunks: list[nn.Module], row: list):
        self.layers = [chunk_layers(c) for c in chunks]
        self.whole = whole_backwards(row, [cl.plain for cl in self.layers])
        self.records: dict = {}

    def recording(self, a, chunk: nn.Module):
        key = (a.micro_batch, a.chunk)
        if key in self.whole:
            return nullcontext([])
        self.records[key] = WeightGradRecord()
        return record_weight_grads(chunk, self.records[key], self.layers[a.chunk])

    def backward(self, a, out, grad, x, kept):
        if (a.micro_batch, a.chunk) in self.whole:
            torch.autograd.backward(out, grad)
            return None if x is None else x.grad
        if x is not None:
            return torch.autograd.grad(out, [x], grad)[0]
        for (entry, _), g in zip(kept, torch.autograd.grad(out, [t for _, t in kept], grad)):
            entry[2] = g
        return None

    def weights(self, a) -> None:
        record = self.records.pop((a.micro_batch, a.chunk), None)
        if record is not None:      # none when its B was whole: the W stays, empty, in the trace
            record.apply()
