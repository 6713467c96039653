"""The rank grid: every rank is one point of `arange(world).view(dp, pp, cp, tp)` (picotron's
grid; the seed's rule "model parallel inside a node, data parallel across nodes" as an index order).

    dims = ParallelDims(dp=2, pp=2, tp=2)     # validated in the launching process
    dims.groups("tp")  -> [[0, 1], [2, 3], [4, 5], [6, 7]]
    mesh = Mesh(dims, rank)                    # on each rank: mesh.size/index/group/ranks("dp")"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch.distributed as dist


class LayoutError(ValueError):
    """A layout that cannot work; the message is one line naming the constraint."""


AXES = ("dp", "pp", "cp", "tp")                 # grid order: outermost to innermost
GROUP_AXES = ("dp", "pp", "cp", "tp", "dp_cp", "ep", "edp")
# Axes with the same ranks share a process group only within one family: each family issues its
# collectives from its own thread, so each gets its own group (docs/core_notes_tp.md, "mesh").
FAMILY = {"dp": "sync", "dp_cp": "sync", "edp": "sync", "cp": "cp", "ep": "ep", "pp": "pp",
          "tp": "tp", "replica": "replica"}


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    replica: int = 1

    @property
    def world_size(self) -> int:
        return self.replica * self.dp * self.pp * self.cp * self.tp

    def validate(self, world_size: int | None = None) -> None:
        """The grid's own constraints; the model- and batch-dependent ones live with the
        rules that need them (refimpl.lab.layout_rules, before launch)."""
        for f in fields(self):
            size = getattr(self, f.name)
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"--{f.name} must be a positive integer (got {size!r})")
        if world_size is not None and world_size != self.world_size:
            raise LayoutError(f"--nproc {world_size} must equal dp x pp x cp x tp = {self.dp} x "
                              f"{self.pp} x {self.cp} x {self.tp}"
                              + (f" x {self.replica} replicas" if self.replica > 1 else "")
                              + f" = {self.world_size}")
        if (self.dp * self.cp) % self.ep:
            raise LayoutError(f"--ep {self.ep} must divide dp x cp = {self.dp * self.cp}: expert "
                              "parallelism reuses the data-parallel ranks")

    # The grid's groups and coordinates, computed on integers, not on a tensor: host bookkeeping
    # (a tensor would be a meta one under the dry run, where `.tolist()` cannot run).
    def _stride(self, axis: str) -> int:
        """How far apart neighbours along `axis` are in rank (tp innermost: 1)."""
        order = ("replica",) + AXES
        stride = 1
        for name in reversed(order[order.index(axis) + 1:]):
            stride *= getattr(self, name)
        return stride

    def groups(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along `axis`, each in group order."""
        if axis in AXES or axis == "replica":
            stride, n = self._stride(axis), getattr(self, axis)
            # every group starts at a rank whose coordinate on `axis` is 0, in rank order
            return [[r + k * stride for k in range(n)] for r in range(self.world_size)
                    if (r // stride) % n == 0]
        if axis in ("dp_cp", "ep", "edp"):
            # dp and cp flattened (dp outer): the ranks that hold the same model shard.
            sdp, scp = self._stride("dp"), self._stride("cp")
            dp_cp = [[r + d * sdp + c * scp for d in range(self.dp) for c in range(self.cp)]
                     for r in range(self.world_size)
                     if (r // sdp) % self.dp == 0 and (r // scp) % self.cp == 0]
            if axis == "dp_cp":
                return dp_cp
            if axis == "ep":   # consecutive chunks of ep ranks inside each dp_cp group
                return [row[i:i + self.ep] for row in dp_cp for i in range(0, len(row), self.ep)]
            return [row[j::self.ep] for row in dp_cp for j in range(self.ep)]   # one rank of each chunk
        raise ValueError(f"unknown axis {axis!r}; axes: {', '.join(GROUP_AXES)}")

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index on every axis."""
        coords = {axis: (rank // self._stride(axis)) % getattr(self, axis)
                  for axis in ("replica",) + AXES}
        for axis in ("dp_cp", "ep", "edp"):
            coords[axis] = next(g.index(rank) for g in self.groups(axis) if rank in g)
        return coords

    def size(self, axis: str) -> int:
        if axis == "dp_cp":
            return self.dp * self.cp
        if axis == "edp":
            return self.dp * self.cp // self.ep
        return getattr(self, axis)


class Mesh:
    """This rank's place in the grid and one process group per axis."""

    def __init__(self, dims: ParallelDims, rank: int):
        self.dims = dims
        self.rank = rank
        self.coords = dims.coordinates(rank)
        self._ranks: dict[str, list[int]] = {}
        self._groups: dict = {}
        distributed = dist.is_available() and dist.is_initialized()
        made = _groups_of_this_world() if distributed else {}
        for axis in GROUP_AXES + ("replica",):
            for ranks in dims.groups(axis):
                key = (FAMILY[axis], tuple(ranks))
                if distributed and len(ranks) > 1 and key not in made:
                    made[key] = dist.new_group(ranks)
                if rank in ranks:
                    self._ranks[axis], self._groups[axis] = ranks, made.get(key)

    def size(self, axis: str) -> int:
        return len(self._ranks[axis])

    def index(self, axis: str) -> int:
        """This rank's position along `axis` (its rank inside that axis's group)."""
        return self.coords[axis]

    def group(self, axis: str):
        """The process group along `axis`, or None when the axis has one rank (nothing to do)."""
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        return list(self._ranks[axis])

    def global_rank(self, axis: str, index: int) -> int:
        """The global rank at position `index` of this rank's group along `axis` (torch's
        point-to-point calls and `dst`/`src` arguments want global ranks)."""
        return self._ranks[axis][index]

    def __repr__(self) -> str:
        shape = " x ".join(f"{a}{self.dims.size(a)}" for a in AXES if self.dims.size(a) > 1)
        at = ", ".join(f"{a}={self.coords[a]}" for a in AXES if self.dims.size(a) > 1)
        return f"Mesh({shape or 'single'}; rank {self.rank}: {at})"


# The groups made in this process, by family and member ranks, for the default group they were
# made in: later runs in the same processes reuse them (docs/core_notes_tp.md, "mesh").
_MADE: dict = {"world": None, "groups": {}}


def _groups_of_this_world() -> dict[tuple, object]:
    world = dist.group.WORLD
    if _MADE["world"] is not world:      # a new default group (a restart, the dry run's fake one)
        _MADE["world"], _MADE["groups"] = world, {}
    return _MADE["groups"]
