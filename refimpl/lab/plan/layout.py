"""A layout: the sizes of the grid's axes and the techniques each GPU applies.

The grid is refimpl.mesh's: ranks arange(world).view(dp, pp, cp, tp), tp innermost. An axis whose
group spans at most one node talks over NVLink, otherwise over InfiniBand (seed 003: model
parallelism inside a node, data parallelism across nodes): `Layout.within_node` says which.
"""
from __future__ import annotations

from dataclasses import dataclass

from refimpl.mesh import AXES as GRID_AXES  # dp, pp, cp, tp: outermost to innermost

AXES_INNER_FIRST = tuple(reversed(GRID_AXES))   # innermost (neighbouring ranks) first


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    recompute: str = "none"            # "none", "selective" (attention scores), "full" (per block)
    sequence_parallel: bool = False
    ep: int = 1                        # expert parallelism, inside dp x cp (refimpl.lab.plan.moe)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def within_node(self, axis: str, gpus_per_node: int) -> bool:
        """Does every group along `axis` sit inside one node? Its ranks are `stride` apart, stride
        being the product of the axes inside it; the group spans stride·size consecutive ranks."""
        stride = 1
        for name in AXES_INNER_FIRST:
            if name == axis:
                break
            stride *= getattr(self, name)
        span = stride * getattr(self, axis)
        return span <= gpus_per_node and gpus_per_node % span == 0

    def to_dict(self) -> dict:
        # shallow, by hand: dataclasses.asdict deep-copies and was half of a 80k-layout search
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
