"""The pipeline runner's speed-ups, a plug-in of the core's step (refimpl.parallel.pp.runner):
the same messages and the same gradients, less time.

    run_schedule(chunks, table, micro, group)     # runs on `parts()`: PostedLinks, MergedBackward

Entry point (pyproject.toml): "refimpl.pipeline" (`parts`). `run_schedule(..., links=Links,
backward=Backward)` runs the core's own step.

- `PostedLinks`: the posting order made once per table (a unit-time replay of the table costs
  milliseconds at every step otherwise); on gloo every receive of the step posted at its start, in
  the step's order. gloo runs each posted operation on its own, so an early receive holds nothing
  back, and gloo copies a message on the sender's thread when its receive is already there instead
  of on its own thread later (scripts/bench_pp.py's docstring). Its checks name a broken order.
- `MergedBackward`: a B followed at once by its own W, on a chunk without experts or ZeRO-3/FSDP
  units, runs as one plain backward (PyTorch's pipelining merges such a pair too); so does the
  first piece's W, which has no input gradient to send: its B keeps the output's gradient and W
  runs the plain backward from there. The layers W covers are found once per step, not at every
  F, and a W enters autograd's engine once per block (`BlockRecord`), not once per layer (about
  0.15 ms a call on a CPU).
"""
from __future__ import annotations

from contextlib import nullcontext
from functools import lru_cache

import torch

from refimpl.model.moe import MoEMLP
from refimpl.parallel.pp.links import Links
from refimpl.parallel.pp.order import n_pieces, rank_order
from refimpl.parallel.pp.runner import Backward
from refimpl.parallel.pp.schedules import Action, parse_entry
from refimpl.parallel.pp.zero_bubble import WeightGradRecord, parameters, record_weight_grads, weight_layers
from refimpl.placement import is_resharded
from refimpl.seam import dist


def parts() -> tuple[type, type]:
    """The "refimpl.pipeline" entry point: the Links and Backward the runner uses by default."""
    return PostedLinks, MergedBackward


@lru_cache(maxsize=64)
def _plan(table: tuple, rank: int, where: str) -> tuple[int, list]:
    """Links.plan, once per (table, rank, placement)."""
    return n_pieces([[parse_entry(e) for e in row] for row in table]), rank_order(table, rank, where)


class PostedLinks(Links):
    def __init__(self, group, table, where, micro_batches, shape, like=None):
        super().__init__(group, table, where, micro_batches, shape, like)
        self.next = 0                   # ops[:next] are posted (some later ones may be too)
        if group is not None and dist.get_backend(group) == "gloo":
            for op in self.ops:
                if not op[0]:
                    self.post(op)

    def plan(self, table):
        return _plan(tuple(map(tuple, table)), self.rank, self.where)

    def post_through(self, op: tuple) -> None:
        """Post this rank's operations in order, up to and including `op`, skipping those posted
        already."""
        while op not in self.done:
            if self.next == len(self.ops):
                raise RuntimeError(f"pipeline p2p: {op} is not in the step's order")
            self.next += 1
            if self.ops[self.next - 1] not in self.done:
                self.post(self.ops[self.next - 1])

    def post(self, op: tuple) -> None:
        is_send, _, message = op
        if is_send and message not in self.ready:
            raise RuntimeError(f"pipeline p2p: the order sends {message} before its action ran")
        super().post(op)

    def finish(self) -> None:
        if len(self.done) != len(self.ops):
            raise RuntimeError(f"pipeline p2p: {len(self.ops) - len(self.done)} operations never posted")
        super().finish()


def is_plain(chunk) -> bool:
    """No experts and no ZeRO-3/FSDP unit: one plain backward may do B and W together."""
    return (not any(isinstance(m, MoEMLP) for m in chunk.modules())
            and not any(is_resharded(p) for p in chunk.parameters()))


def whole_backwards(entries: list[list[Action]], plain: list[bool]) -> frozenset:
    """The (micro-batch, chunk) whose B is followed at once by its own W, on a chunk that may take
    a plain backward: one whole backward does both."""
    whole = set()
    for entry, after in zip(entries, entries[1:]):
        b = entry[-1]               # a pair (F&B) runs its B last
        if len(after) == 1 and (b.kind, after[0].kind) == ("B", "W"):
            w = after[0]
            if (b.micro_batch, b.chunk) == (w.micro_batch, w.chunk) and plain[b.chunk]:
                whole.add((b.micro_batch, b.chunk))
    return frozenset(whole)


class BlockRecord(WeightGradRecord):
    """W's gradients handed to autograd one block at a time, last block first."""

    def __init__(self, block_of: dict[int, str]):
        super().__init__()
        self.block_of = block_of        # id(layer) -> its block ("blocks.3", "lm_head")

    def apply(self) -> None:
        params, grads_in, block = [], [], None
        for module, grads in self.gradients():
            if self.block_of[id(module)] != block and params:
                torch.autograd.backward(params, grads_in)
                params, grads_in = [], []
            block = self.block_of[id(module)]
            params += parameters(module)
            grads_in += grads
        if params:
            torch.autograd.backward(params, grads_in)
        self.entries.clear()


class MergedBackward(Backward):
    def __init__(self, chunks: list, row: list[list[Action]]):
        super().__init__(chunks, row)
        plain = [is_plain(c) for c in chunks] if self.split else []
        self.whole = whole_backwards(row, plain) if self.split else frozenset()
        self.first = {c for c, chunk in enumerate(chunks) if self.split and chunk.is_first and plain[c]}
        self.deferred: dict = {}        # the first piece's (micro-batch, chunk) -> (output, its gradient)
        self.layers = [weight_layers(c) for c in chunks] if self.split else []
        self.block_of = [{id(m): ".".join(name.split(".")[:2]) for name, m in layers} for layers in self.layers]

    def merged(self, a: Action) -> bool:
        return (a.micro_batch, a.chunk) in self.whole or a.chunk in self.first

    def recording(self, a: Action, chunk):
        if self.merged(a) or not self.split:
            return nullcontext([])
        self.records[(a.micro_batch, a.chunk)] = record = BlockRecord(self.block_of[a.chunk])
        return record_weight_grads(chunk, record, self.layers[a.chunk])

    def backward(self, a: Action, out, grad, x, kept):
        if (a.micro_batch, a.chunk) in self.whole:
            torch.autograd.backward(out, grad)
            return None if x is None else x.grad
        if a.chunk in self.first:
            self.deferred[(a.micro_batch, a.chunk)] = (out, grad)
            return None
        return super().backward(a, out, grad, x, kept)

    def weights(self, a: Action) -> None:
        key = (a.micro_batch, a.chunk)
        if key in self.deferred:
            torch.autograd.backward(*self.deferred.pop(key))
        elif key not in self.whole:
            super().weights(a)
