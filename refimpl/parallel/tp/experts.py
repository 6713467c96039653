"""Experts under tensor parallelism: every expert's MLP split over tp like the dense one (up
column-, down row-parallel), the router replicated. This is Megatron-core's expert tensor
parallelism with its size equal to tp (Liu et al. 2025, "MoE Parallel Folding", arXiv
2504.14960), which composes with any ep unchanged: ep groups are chunks of dp x cp at one tp
coordinate (refimpl.mesh). Router and counts see the same tokens on every tp rank, so every tp
rank routes alike; each expert's y is whole (its row layer reduced it) before the gate scales it."""
from __future__ import annotations

from refimpl.model.moe import MoEMLP
from refimpl.parallel.tp.blocks import parallel_feed_forward
from refimpl.parallel.tp.mappings import gather_sequence, split_sequence


def parallelize_moe(moe: MoEMLP, group, sequence_parallel: bool = False,
                    label: str = "tp:moe") -> MoEMLP:
    """Split every expert of `moe` over the tp `group` (in place, names kept: `experts.<e>.up`);
    under sequence parallelism, gather the layer's tokens before it and split them after."""
    for key in list(moe.experts.keys()):
        moe.experts[key] = parallel_feed_forward(moe.experts[key], group, sequence_parallel=False,
                                                 label=f"{label}.experts.{key}")
    if sequence_parallel:
        moe.register_forward_pre_hook(
            lambda module, args: (gather_sequence(args[0], group),) + tuple(args[1:]))
        moe.register_forward_hook(lambda module, args, out: split_sequence(out, group))
    return moe
