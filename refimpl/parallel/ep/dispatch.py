"""Expert parallelism: each rank of an ep group holds E/ep experts; tokens travel by all-to-all."""
from __future__ import annotations

import torch
import torch.nn as nn

from refimpl.model.moe import moe_layers
from refimpl.model.moe_slots import compact_destinations, pack, unpack
from refimpl.parallel.ep.counts import SharedCounts
from refimpl.placement import Owned, Shard, placement_of, set_placement
from refimpl.seam import dist, phase


def exchange(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single with equal pieces: piece j of x goes to rank j of `group`."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """`exchange` as an autograd op: backward sends the gradients back along the same edges."""

    @staticmethod
    def forward(ctx, x, group, kind: str):
        ctx.group, ctx.kind = group, kind
        return exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        with phase(f"moe:{ctx.kind}.backward"):
            return exchange(grad, ctx.group), None, None


class ExpertParallelDispatch(SharedCounts):
    """The `dispatch` of an MoE layer whose experts are spread over `ep_group`; the counts shared
    over `token_group` (ep's group itself when ep spans the data-parallel ranks, dp x cp's when
    ep is smaller)."""

    def __init__(self, ep_group, token_group, n_experts: int):
        super().__init__(token_group)
        self.ep_group, self.n_experts = ep_group, n_experts
        self.ep = dist.get_world_size(ep_group)
        self.local = n_experts // self.ep
        self.first = dist.get_rank(ep_group) * self.local      # my first expert's global index

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, room: int | None,
                 experts: nn.ModuleDict) -> tuple:
        """x: [E, B, d], expert e's kept rows first, zero padding after; counts: [E] kept rows per
        expert. Returns the outputs in x's layout and recv [ep, E/ep]: rows each rank sent mine."""
        n_experts, bound, d = x.shape
        with phase("moe:dispatch"):
            # recv[s, j]: the rows rank s sends my expert j
            recv = exchange(counts, self.ep_group).view(self.ep, self.local)
            rows = AllToAll.apply(x.reshape(n_experts * bound, d), self.ep_group, "dispatch")
            # each local expert's real rows, source after source, in a buffer of `room` rows
            room = self.ep * bound if room is None else min(room, self.ep * bound)
            dest = compact_destinations(recv, bound, room)
            packed = pack(rows, dest, self.local * room).view(self.local, room, d)
        with phase("moe:experts"):
            y = torch.stack([experts[str(self.first + j)](p) for j, p in enumerate(packed)])
            y = unpack(y.reshape(self.local * room, d), dest)   # back to the received layout
        with phase("moe:combine"):
            out = AllToAll.apply(y, self.ep_group, "combine")
        return out.view(n_experts, bound, d), recv


def parallelize_experts(model: nn.Module, ep_group, token_group=None) -> nn.Module:
    """Keep only this rank's E/ep consecutive experts in every MoE layer (in place, names kept);
    each kept parameter is `Owned` by ep (carrying its tp Shard, if any)."""
    token_group = ep_group if token_group is None else token_group
    ep, me = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for layer in moe_layers(model):
        if layer.n_experts % ep:
            raise ValueError(f"{layer.n_experts} experts do not divide over ep = {ep} ranks")
        local = layer.n_experts // ep
        for key in list(layer.experts.keys()):
            if int(key) // local != me:
                del layer.experts[key]
        for key, expert in layer.experts.items():
            for p in expert.parameters():
                inner = placement_of(p) if isinstance(placement_of(p), Shard) else None
                set_placement(p, Owned("ep", "experts", int(key), layer.n_experts, inner))
        layer.dispatch = ExpertParallelDispatch(ep_group, token_group, layer.n_experts)
    return model


def share_routing_counts(model: nn.Module, token_group) -> nn.Module:
    """Data parallelism without ep: every replica keeps all experts but counts its routing over
    the global batch, so capacity, f_i and the dropped tokens are single's."""
    for layer in moe_layers(model):
        layer.dispatch = SharedCounts(token_group)
    return model
