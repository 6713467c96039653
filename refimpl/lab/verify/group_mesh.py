"""A mesh made of process groups built by hand, for the checks that call the core's gathering
outside a training run (refimpl.lab.checkpoint.gather.gather_full_state_dict, unshard)."""
from __future__ import annotations

from refimpl.seam import dist


class GroupMesh:
    """The two questions gather_full_state_dict asks a mesh (`size`, `group`), answered for
    process groups made by hand: GroupMesh(tp=group) in the layer-by-layer TP checks,
    GroupMesh(ep=group) in the MoE tests. Axes not given have size 1."""

    def __init__(self, **groups):
        self._groups = groups

    def size(self, axis: str) -> int:
        group = self._groups.get(axis)
        return 1 if group is None else dist.get_world_size(group)

    def group(self, axis: str):
        return self._groups.get(axis)
