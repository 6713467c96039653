"""Expert parallelism: each rank of an ep group holds E/ep experts; tokens travel by all-to-all.

Seed (000, section 2): all-to-all (각 프로세스가 N개의 조각을 만들어 N개 프로세스 각각에 하나씩
전송) is the collective of MoE expert parallelism. Seed (001): different experts on different
devices, the router sending each token to its experts. The layer (refimpl.model.moe) routes;
this module moves the tokens (GShard, Lepikhin et al. 2020, section 3.2; Megatron-core's
token dispatcher does the same with uneven splits):

  0. counts      all_gather of each rank's per-expert counts over the ranks that hold tokens, so
                 every rank knows its place in each expert's global queue (the capacity is global,
                 as in the single process) and the global load f_i of the aux loss;
  1. counts      all_to_all_single of the kept counts: rank s learns how many rows each rank
                 sends to each of its experts -- the receive split sizes of step 2;
  2. dispatch    all_to_all_single of the token rows, uneven splits (sorted by expert, so the rows
                 for rank r's experts are one contiguous chunk);
  3. experts     each local expert runs on the rows it received, in source-rank order = global
                 batch order (an expert that received nothing still runs, on zero rows);
  4. combine     the reverse all_to_all_single returns each output to the rank its token lives on,
                 where the layer weights it by its gate and adds it up.

Backward runs the two all-to-alls in reverse (`AllToAll`: its backward is the all-to-all with the
split sizes swapped, as Megatron's _AllToAll). Bytes: a rank sends (rows it sends to *other*
ranks) x d x bytes per value in each all-to-all; balanced routing makes that (ep-1)/ep of its k*T
rows (notebook 02's all-to-all volume); `all_to_all_bytes` reads the live count.

Non-expert parameters stay replicated (data-parallel over the same ranks); expert parameters are
not: they must be synchronised only over the ranks holding the *same* experts (the mesh's "edp"
group), never averaged with a different expert's gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.model.moe import LocalExperts, Traffic, all_gather_counts, moe_layers
from refimpl.placement import Owned, Shard, placement_of, set_placement
from refimpl.trace.labels import comm_span, phase


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits as an autograd op: backward sends the gradients
    back along the same edges (split sizes swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, comm, traffic, kind):
        ctx.args = (in_splits, out_splits, group, comm, traffic, kind)
        return _exchange(x, out_splits, in_splits, group, comm, traffic, kind)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits, group, comm, traffic, kind = ctx.args
        back = "combine" if kind == "dispatch" else "dispatch"   # the same edges, reversed
        with phase(f"moe:{kind}.backward"):
            grad_in = _exchange(grad.contiguous(), in_splits, out_splits, group, comm, traffic,
                                back)
        return grad_in, None, None, None, None, None, None


def _exchange(x, out_splits, in_splits, group, comm, traffic, kind):
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    me = dist.get_rank(group)
    sent = (sum(in_splits) - in_splits[me]) * x[:1].numel() * x.element_size()
    setattr(traffic, kind, getattr(traffic, kind) + sent)
    with comm_span("all_to_all", sent):
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class ExpertParallelDispatch:
    """The `dispatch` of an MoE layer whose experts are spread over `ep_group`.

    `token_group`: every rank holding a different slice of the global batch, in batch order (the
    ep group itself when ep spans the data-parallel ranks; the dp x cp group when ep is smaller).
    `comm`: torch.distributed, or refimpl.comm (the from-scratch collectives, same signatures).
    """

    def __init__(self, ep_group, token_group, n_experts: int, comm=dist):
        self.ep_group, self.token_group, self.comm = ep_group, token_group, comm
        self.ep = dist.get_world_size(ep_group)
        self.local = n_experts // self.ep
        self.first = dist.get_rank(ep_group) * self.local
        self.traffic = Traffic()

    def gather_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        return all_gather_counts(counts, self.token_group, self.comm)

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict) -> tuple:
        with phase("moe:dispatch"):
            recv = torch.empty_like(counts)
            with comm_span("all_to_all", counts.nbytes):
                self.comm.all_to_all_single(recv, counts, group=self.ep_group)
            recv = recv.view(self.ep, self.local)     # recv[s, j]: rows rank s sends my expert j
            send_splits = counts.view(self.ep, self.local).sum(dim=1).tolist()
            recv_splits = recv.sum(dim=1).tolist()
            rows = AllToAll.apply(x, recv_splits, send_splits, self.ep_group, self.comm,
                                  self.traffic, "dispatch")
            order = expert_major(recv)
        with phase("moe:experts"):
            parts = torch.split(rows[order], recv.sum(dim=0).tolist())
            y = torch.cat([experts[str(self.first + j)](p) for j, p in enumerate(parts)])
            y = y[torch.argsort(order)]                # back to the source-major layout
        with phase("moe:combine"):
            out = AllToAll.apply(y, send_splits, recv_splits, self.ep_group, self.comm,
                                 self.traffic, "combine")
        return out, recv


def expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Row order that regroups received rows (laid out source-major, expert-minor) expert-major,
    source-minor -- i.e. for each local expert, its rows in global batch order."""
    start = torch.cumsum(recv.reshape(-1), 0).view_as(recv) - recv
    pieces = [torch.arange(int(start[s, j]), int(start[s, j] + recv[s, j]), device=recv.device)
              for j in range(recv.shape[1]) for s in range(recv.shape[0])]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=recv.device)


# --- the transform and its inverse ------------------------------------------------------------------

def parallelize_experts(model: nn.Module, ep_group, token_group=None, comm=dist) -> nn.Module:
    """Keep only this rank's experts (E/ep consecutive ones) in every MoE layer, in place.

    Names stay the reference's (`blocks.0.mlp.experts.2.up.weight`); each kept parameter records
    the placement `Owned("ep", "experts", index, E)` (refimpl.placement: the one record every
    sharded parameter carries, which gathers the full state dict), carrying the tp Shard of an
    expert that tensor parallelism split before. Non-expert parameters are untouched
    (replicated).
    """
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
                # an expert already split over tp (refimpl.parallel.tp.experts) keeps that Shard
                inner = placement_of(p) if isinstance(placement_of(p), Shard) else None
                set_placement(p, Owned("ep", "experts", int(key), layer.n_experts, inner))
        layer.dispatch = ExpertParallelDispatch(ep_group, token_group, layer.n_experts, comm)
    return model


def share_routing_counts(model: nn.Module, token_group, comm=dist) -> nn.Module:
    """Data parallelism without expert parallelism: every replica keeps all experts, but counts
    its routing over the whole global batch (one all-gather of E counts per layer), so capacity
    and the aux loss's f_i are the single process's, and so are the dropped tokens."""
    for layer in moe_layers(model):
        layer.dispatch = LocalExperts(token_group, comm)
    return model


def is_expert_param(p: torch.Tensor) -> bool:
    return isinstance(placement_of(p), Owned)
