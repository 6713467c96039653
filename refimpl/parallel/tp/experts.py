"""Experts under tensor parallelism: every expert's MLP split over tp, the router replicated.

Two ways exist to run an MoE layer on a tensor-parallel group of t ranks, which all hold the same
tokens (without SP) or the same tokens once gathered (with SP):

  (a) expert tensor parallelism: every expert is split like the dense MLP -- `up` column-
      parallel, `down` row-parallel -- so each tp rank holds 1/t of every expert it holds, and
      the t ranks compute every routed row together (one all-reduce per expert per pass);
  (b) fold tp into ep for the MoE layers: the t ranks split the *experts* instead of their
      matrices, and each rank of the group handles only 1/t of the group's tokens, so that a
      token is dispatched once and not t times.

Megatron-core offers both (`--expert-tensor-parallel-size`, 1 = experts whole, with ep "folded"
over the tp ranks: Liu et al. 2025, "MoE Parallel Folding", arXiv 2504.14960); DeepSeek-V3
trains with no tensor parallelism at all (DeepSeek-AI 2024, §3.2: EP across nodes, "we do not
use costly TP"). We build (a), the expert-tensor-parallel size equal to tp, because in this
project's grid ep reuses the dp x cp ranks (refimpl.mesh: an ep group is a chunk of a dp_cp
group at one tp coordinate), so (a) composes with any ep unchanged: the t ranks of a tp group
run the same all-to-all at their own tp coordinate, each carrying the same rows, and every expert
they receive is one tensor-parallel MLP among them. (b) would need ep groups that cross tp,
a token split inside the MoE layer and its gather after it -- a different grid, not a transform.
The price of (a) is Megatron's known one: small per-expert matmuls (d_ff / t wide) and t
all-reduces of the routed rows, where (b) sends each row once.

What stays exact:
  router        replicated (not split), applied to the same tokens on every tp rank, so every tp
                rank routes identically; its gradient, from identical inputs, is identical too;
  expert y      full on every rank (the row-parallel `down` all-reduces it) *before* the gate
                multiplies it -- a partial y would make the gate's gradient partial;
  counts        gathered over the token-holding ranks (dp x cp), never over tp: the capacity and
                the aux loss's f_i count each token once, not t times; the aux loss is computed on
                every tp rank alike and added once per rank, as the language-model loss is.

With --sequence-parallel the residual stream holds s/t tokens per rank. The MoE layer is then a
replicated region inside SP: its input is all-gathered along the sequence (`gather_sequence`,
backward: keep my slice -- the region's input gradient is already whole on every rank) and its
output cut back to this rank's slice (`split_sequence`, backward: all-gather). Same tokens in the
router on every rank, so the same routing; attention and the dense parts keep SP's savings.
"""
from __future__ import annotations

import torch.distributed as dist

from refimpl.model.moe import MoEMLP
from refimpl.parallel.tp.layers import parallel_feed_forward
from refimpl.parallel.tp.mappings import gather_sequence, split_sequence


def parallelize_moe(moe: MoEMLP, group, sequence_parallel: bool = False, comm=None,
                    label: str = "tp:moe") -> MoEMLP:
    """Split every expert of `moe` over the tp `group` (in place, names kept: `experts.<e>.up`);
    under sequence parallelism, gather the layer's tokens before it and split them after."""
    comm = comm or dist
    for key in list(moe.experts.keys()):
        expert = parallel_feed_forward(moe.experts[key], group, sequence_parallel=False, comm=comm)
        expert.label = f"{label}.experts.{key}"
        moe.experts[key] = expert
    if sequence_parallel:
        moe.register_forward_pre_hook(
            lambda module, args: (gather_sequence(args[0], group, comm),) + tuple(args[1:]))
        moe.register_forward_hook(lambda module, args, out: split_sequence(out, group, comm))
    return moe
