"""Experts under tensor parallelism (expert tensor parallelism of size tp; Liu et al. 2025, arXiv
2504.14960): every expert's MLP split like the dense one, the router replicated."""
from __future__ import annotations

from refimpl.model.moe import MoEMLP
from refimpl.parallel.tp.blocks import parallel_feed_forward
from refimpl.parallel.tp.mappings import gather_sequence, split_sequence


def parallelize_moe(moe: MoEMLP, group, sequence_parallel: bool = False) -> MoEMLP:
    """Split every expert of `moe` over tp (in place, names kept); under SP, gather the layer's
    tokens before it and split them after."""
    for key in list(moe.experts.keys()):
        moe.experts[key] = parallel_feed_forward(moe.experts[key], group, sequence_parallel=False)
    if sequence_parallel:
        moe.register_forward_pre_hook(
            lambda module, args: (gather_sequence(args[0], group),) + tuple(args[1:]))
        moe.register_forward_hook(lambda module, args, out: split_sequence(out, group))
    return moe
