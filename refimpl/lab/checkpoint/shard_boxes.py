"""Where a rank's piece of a tensor sits in the reference's tensor: boxes (offsets, lengths).

A sharded checkpoint (refimpl.lab.checkpoint.sharded_checkpoint) stores every tensor as pieces, each a
rectangular box of the reference's full tensor. A model-parallel part (a tp slice, an owned
expert) is one box; a ZeRO/FSDP flat shard covers a flat range of a tensor, which in row-major
order is a few boxes (a partial first row, whole rows, a partial last row: `flat_range_boxes`).
Loading under another layout intersects the boxes a rank needs with the boxes on disk
(`intersect`): the idea of torch.distributed.checkpoint's chunk metadata, written from scratch.
A Hugging Face folder (`--init-hf`) is read by boxes too (`BoxedParts`): each rank reads the
slices its placement keeps, never a whole matrix it then cuts.
"""
from __future__ import annotations

import math

import torch.nn.functional as F

from refimpl.lab.rank_build.values import PartialState
from refimpl.placement import Owned, Shard


def part_box(shape, where, mesh, full_shape) -> tuple[tuple, tuple]:
    """The box of the reference tensor (of `full_shape`) that a rank's model-parallel part of
    local `shape` holds; a padded vocabulary's padding rows are cut off (they are not the
    reference's)."""
    if isinstance(where, Owned):
        where = where.within
    offsets, lengths = [0] * len(shape), list(shape)
    if isinstance(where, Shard):
        start = mesh.index(where.axis) // where.repeats * shape[where.dim]
        offsets[where.dim] = start
        lengths[where.dim] = max(0, min(shape[where.dim], full_shape[where.dim] - start))
    return tuple(offsets), tuple(lengths)


def full_shape_of(shape, where) -> tuple:
    if isinstance(where, Owned):
        where = where.within
    shape = list(shape)
    if isinstance(where, Shard):
        shape[where.dim] = where.full
    return tuple(shape)


def flat_range_boxes(shape, start: int, stop: int) -> list[tuple[tuple, tuple]]:
    """The elements [start, stop) of a row-major tensor of `shape` as boxes, in that order."""
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    r0, c0 = divmod(start, row)
    r1, c1 = divmod(stop, row)

    def in_row(r, a, b):
        return [((r, *o), (1, *n)) for o, n in flat_range_boxes(shape[1:], a, b)]
    if r0 == r1:
        return in_row(r0, c0, c1)
    boxes = []
    if c0:
        boxes += in_row(r0, c0, row)
        r0 += 1
    if r1 > r0:
        boxes.append(((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:
        boxes += in_row(r1, 0, c1)
    return boxes


def intersect(a_off, a_len, b_off, b_len):
    """The common box of two boxes (None if they do not meet)."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_len, b_off, b_len)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


def read_part(reader, name: str, shape, where, mesh):
    """This rank's part (local `shape`, placement `where`) of the reference tensor `name`, read
    through `reader.box(name, offsets, lengths)` alone; a padded vocabulary's rows past the
    reference's come as zeros, as refimpl.lab.checkpoint.gather.local_part pads them."""
    off, length = part_box(shape, where, mesh, reader.shape_of(name))
    part = reader.box(name, off, length)
    if tuple(length) != tuple(shape):
        w = where.within if isinstance(where, Owned) else where
        pad = shape[w.dim] - length[w.dim]
        part = F.pad(part, [0, 0] * (len(shape) - 1 - w.dim) + [0, pad])
    return part


class BoxedParts(PartialState):
    """A reference state read lazily by boxes (`shape_of(name)`, `box(name, offsets, lengths)`:
    a Hugging Face folder, refimpl.lab.checkpoint.hf.HubState) as the PartialState
    refimpl.lab.rank_build.values places from: each rank reads only the box of the part it keeps."""

    def __init__(self, boxed):
        self.boxed = boxed

    def __getitem__(self, name: str):
        return self.boxed[name]

    def __iter__(self):
        return iter(self.boxed)

    def __len__(self) -> int:
        return len(self.boxed)

    def shape_of(self, name: str) -> tuple:
        return self.boxed.shape_of(name)

    def read_part(self, name, shape, where, mesh):
        return read_part(self.boxed, name, shape, where, mesh)
