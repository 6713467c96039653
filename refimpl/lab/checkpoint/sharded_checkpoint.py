"""A sharded checkpoint: each rank writes the pieces it holds, one index says where they are.

    step-00000010/index.json               every tensor's global shape, dtype and pieces:
                                            {file, key, offsets, lengths} (refimpl.lab.checkpoint.shard_boxes)
    step-00000010/rank-00003.safetensors   rank 3's pieces: weights, AdamW's m and v it owns

`rank_pieces` lists what this rank holds, in the reference's names, each piece a box of the
reference's tensor: a plain layout's model-parallel parts (tp slices, pipeline stages), a ZeRO/FSDP
flat shard's ranges. A piece several ranks hold (a replicated weight) is written once, by the
one of them with the fewest bytes to write so far (`dedupe`: one exchange of names and boxes, no
tensor moves), so the ranks' files are even to within one piece: left to the lowest holder, rank
0 of a ZeRO-1 run wrote every weight, three times another rank's file at 4 ranks. `ShardedTensors`
reads under any other layout only the boxes a rank needs (safetensors' get_slice reads a slice
of a tensor from the file, not the tensor), so no rank holds more than its shard plus one piece.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from refimpl.lab.checkpoint.gather import placements
from refimpl.lab.checkpoint.optim_reshard import MOMENTS, _holders
from refimpl.lab.checkpoint.shard_boxes import flat_range_boxes, full_shape_of, intersect, part_box, read_part
from refimpl.lab.rank_build.values import PartialState

INDEX = "index.json"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _add_part(out, kind, name, t, where, mesh):
    full = full_shape_of(t.shape, where)
    off, length = part_box(t.shape, where, mesh, full)
    if all(n > 0 for n in length):
        part = t.detach()[tuple(slice(0, n) for n in length)]
        out.append((kind, name, full, off, length, part))


def _add_flat(out, kind, flat, shard, index, where_of, mesh):
    """A flat shard's range of each slot it reaches into, as boxes of the reference's tensors."""
    lo, hi = index * flat.shard_numel, (index + 1) * flat.shard_numel
    for slot in flat.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a >= b:
            continue
        where = where_of.get(slot.name)
        full = full_shape_of(slot.shape, where)
        base, kept = part_box(slot.shape, where, mesh, full)
        segment = shard.detach()[a - lo:b - lo]
        k = 0
        for off, length in flat_range_boxes(tuple(slot.shape), a - slot.offset, b - slot.offset):
            n = max(1, int(torch.Size(length).numel()))
            piece = segment[k:k + n].view(length)
            k += n
            # cut what lies in a padded vocabulary's padding (beyond the reference's rows)
            box = intersect(tuple(x + y for x, y in zip(base, off)), length, base, kept)
            if box is None:
                continue
            start = tuple(b_ - x - y for b_, x, y in zip(box[0], base, off))
            piece = piece[tuple(slice(s, s + n) for s, n in zip(start, box[1]))]
            out.append((kind, slot.name, full, box[0], box[1], piece))


def rank_pieces(strategy) -> list[tuple]:
    """[(kind, name, full shape, offsets, lengths, tensor)]: what this rank holds. kind is
    "weights", "exp_avg" or "exp_avg_sq". Local: no collective."""
    mesh, where_of, out = strategy.mesh, placements(strategy.model), []
    flat_weights = set()
    if hasattr(strategy, "units"):                       # zero3 / fsdp: the weights are shards
        for u in strategy.units:
            _add_flat(out, "weights", u.flat, u.master, u.rank, where_of, mesh)
            flat_weights |= {s.name for s in u.flat.slots}
    for name, t in strategy.model.state_dict(keep_vars=True).items():
        if name not in flat_weights:
            _add_part(out, "weights", name, t, where_of.get(name), mesh)
    for opt, master, flat, _, index, name in _holders(strategy):
        state = opt.state[master]
        for m in MOMENTS:
            if flat is None:
                _add_part(out, m, name, state[m], where_of.get(name), mesh)
            else:
                _add_flat(out, m, flat, state[m], index, where_of, mesh)
    return out


def _key(kind, name, off) -> str:
    return f"{kind}/{name}@" + ",".join(map(str, off))


def dedupe(pieces, rank: int) -> tuple[list, dict]:
    """Keep the pieces this rank is chosen to write; and the index of every rank's pieces
    (one all_gather_object of names and boxes). A piece one rank holds is its own; a piece several
    hold goes, in the order listed, to the holder with the fewest bytes so far (every rank makes
    the same choices from the same lists). Collective when distributed."""
    mine = [(kind, name, list(full), list(off), list(length), t.element_size(),
             str(t.dtype).removeprefix("torch.")) for kind, name, full, off, length, t in pieces]
    every = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    holders: dict[tuple, list[int]] = {}
    listing: dict[tuple, tuple] = {}
    for r, listed in enumerate(every):
        for kind, name, full, off, length, itemsize, dtype in listed:
            ident = (kind, name, tuple(off), tuple(length))
            holders.setdefault(ident, []).append(r)
            listing.setdefault(ident, (full, off, length, itemsize, dtype))
    load = [0] * len(every)
    writer = {}
    for shared in (False, True):           # each rank's own pieces first: they are fixed
        for ident, ranks in holders.items():
            if (len(ranks) > 1) == shared:
                writer[ident] = min(ranks, key=lambda r: (load[r], r))
                load[writer[ident]] += math.prod(ident[3]) * listing[ident][3]
    tensors = {}
    for ident, r in writer.items():
        kind, name = ident[:2]
        full, off, length, _, dtype = listing[ident]
        entry = tensors.setdefault(f"{kind}/{name}", {"shape": full, "dtype": dtype, "pieces": []})
        entry["pieces"].append({"file": rank_file(r), "key": _key(kind, name, off),
                                "offsets": off, "lengths": length})
    keep = {ident for ident, r in writer.items() if r == rank}
    chosen = {_key(k, n, o): t.contiguous() for k, n, f, o, ln, t in pieces
              if (k, n, tuple(o), tuple(ln)) in keep}
    return chosen, tensors


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(tensors: dict, path) -> None:
    """safetensors to a temporary name beside `path`, fsync, rename: `path` is whole or absent."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class ShardedTensors(PartialState):
    """One kind ("weights", "exp_avg", ...) of a sharded checkpoint, as a reference state dict
    read lazily: `[name]` assembles one whole tensor; `read_part` only this rank's part."""

    def __init__(self, checkpoint: "ShardedCheckpoint", kind: str):
        self.ck, self.kind = checkpoint, kind
        self.names = [k.split("/", 1)[1] for k in checkpoint.index["tensors"]
                      if k.startswith(kind + "/")]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def shape_of(self, name: str) -> tuple:
        return tuple(self.ck.index["tensors"][f"{self.kind}/{name}"]["shape"])

    def box(self, name: str, off, length) -> torch.Tensor:
        """The box (offsets, lengths) of the reference tensor `name`, read from the pieces that
        meet it and nothing else."""
        entry = self.ck.index["tensors"][f"{self.kind}/{name}"]
        meeting = [(piece, common) for piece in entry["pieces"]
                   if (common := intersect(off, length, piece["offsets"], piece["lengths"]))]
        if len(meeting) == 1 and meeting[0][1] == (tuple(off), tuple(length)):
            return self._read(*meeting[0])  # one piece holds the box: its slice, nothing to assemble
        out = torch.zeros(length, dtype=getattr(torch, entry["dtype"]))
        for piece, (lo, n) in meeting:
            out[tuple(slice(a - o, a - o + k) for a, o, k in zip(lo, off, n))] = \
                self._read(piece, (lo, n))
        return out

    def _read(self, piece: dict, common: tuple) -> torch.Tensor:
        """The box `common` (offsets, lengths in the reference's tensor) of one piece, from its
        file: safetensors reads that slice, not the piece."""
        lo, n = common
        src = tuple(slice(a - p, a - p + k) for a, p, k in zip(lo, piece["offsets"], n))
        with self.ck.file(piece["file"]) as f:   # the tensor keeps the mapping while it lives
            return f.get_slice(piece["key"])[src] if src else f.get_tensor(piece["key"])

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shape_of(name)
        return self.box(name, (0,) * len(shape), shape)

    def read_part(self, name, shape, where, mesh) -> torch.Tensor:
        return read_part(self, name, shape, where, mesh)


class ShardedCheckpoint:
    def __init__(self, path):
        self.path = Path(path)
        self.index = json.loads((self.path / INDEX).read_text())

    def file(self, name: str):
        """One rank file, opened for one read (`with ck.file(name) as f`). safetensors maps it,
        and every page a read touched stays in this process's resident set for as long as the
        file is open: kept open for the run, a rank loading resharded held the pages of every
        parameter it had read from (up to 370 MiB beyond its 97 MiB shard, 8 ranks of a 51 M
        model: scripts/resident_memory.py)."""
        return safe_open(str(self.path / name), framework="pt")

    def tensors(self, kind: str) -> ShardedTensors:
        return ShardedTensors(self, kind)
