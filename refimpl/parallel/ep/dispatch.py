"""Expert parallelism: each rank of an ep group holds E/ep experts; tokens travel by all-to-all.

Seed (000, section 2): all-to-all (각 프로세스가 N개의 조각을 만들어 N개 프로세스 각각에 하나씩
전송) is the collective of MoE expert parallelism. Seed (001): different experts on different
devices, the router sending each token to its experts. The layer (refimpl.model.moe) routes;
this module moves the tokens (GShard, Lepikhin et al. 2020, section 3.2; Megatron-core's
token dispatcher does the same with uneven splits):

  0. counts      all_gather of each rank's per-expert counts over the ranks that hold tokens, so
                 every rank knows its place in each expert's global queue (the capacity is global,
                 as in the single process) and the global load f_i of the aux loss;
  1. counts      all_to_all_single of the kept counts: rank s learns how many of the rows each
                 rank sends to each of its experts are real (on the device: no split sizes read);
  2. dispatch    all_to_all_single of the token rows with equal splits: every rank sends each
                 peer E/ep * B rows, its fixed [E, B] buffer (refimpl.model.moe_slots: an expert's
                 real rows first, zero padding after; B from the shapes alone);
  3. experts     each local expert runs on a buffer of min(C, ep * B) rows (`room`) holding the
                 real rows it received, in source-rank order = global batch order, then padding
                 (an expert that received nothing still runs, on padding only);
  4. combine     the reverse all_to_all_single returns each output to its slot on the rank its
                 token lives on, where the layer weights it by its gate and adds it up.

No host read: every size above is known from the batch's shape (GShard's fixed-capacity
dispatch), so NCCL's stream never waits for the host. The price is the padding. Under the batch
scope's global capacity one rank may send one expert up to B = min(C, T) rows (all of the C a
whole batch may give it), so each all-to-all carries E * B rows where balanced routing fills
k * T of them (T: this rank's tokens; C = k * cf * ranks * T / E): min(cf * ranks, E / k) times
more, E / k once C >= T, i.e. with many token-holding ranks (notebook 08 §7: 2x). Under
the sequence scope B = min(rows * C_seq, T), which is k * cf * T / E (rounded up per sequence)
when k * cf <= E: the buffers are then k * cf * T rows, GShard's (refimpl.model.moe_slots).

Backward runs the two all-to-alls in reverse (`AllToAll`, as Megatron's _AllToAll). Bytes
(`Traffic`, read after the step by refimpl.model.moe.all_to_all_bytes): `sent` counts what goes on
the wire, every peer's whole piece of the [E, B] buffer ((ep-1)/ep of E * B rows x d x bytes per
value per all-to-all, padding included: the number the comm span carries); beside it the routed
rows this rank sends to *other* ranks (balanced routing: (ep-1)/ep of its k*T rows, notebook 02's
all-to-all volume), device tensors counted without a host read. The difference is padding.

Non-expert parameters stay replicated (data-parallel over the same ranks); expert parameters are
not: they must be synchronised only over the ranks holding the *same* experts (the mesh's "edp"
group), never averaged with a different expert's gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.labels import comm_span, phase
from refimpl.model.moe import Traffic, moe_layers
from refimpl.model.moe_slots import compact_destinations, pack, unpack
from refimpl.parallel.ep.counts import SharedCounts, all_gather_counts
from refimpl.placement import Owned, Shard, placement_of, set_placement


class AllToAll(torch.autograd.Function):
    """all_to_all_single with equal splits as an autograd op: backward sends the gradients back
    along the same edges. `rows` (forward, backward): device tensors, the routed rows this rank
    sends to other ranks in each pass (the real rows among the buffer's, for `Traffic`)."""

    @staticmethod
    def forward(ctx, x, group, comm, traffic, kind, rows):
        ctx.args = (group, comm, traffic, kind, rows)
        return _exchange(x, group, comm, traffic, kind, rows[0])

    @staticmethod
    def backward(ctx, grad):
        group, comm, traffic, kind, rows = ctx.args
        back = "combine" if kind == "dispatch" else "dispatch"   # the same edges, reversed
        with phase(f"moe:{kind}.backward"):
            grad_in = _exchange(grad.contiguous(), group, comm, traffic, back, rows[1])
        return grad_in, None, None, None, None, None


def _exchange(x, group, comm, traffic, kind, routed_rows):
    out = torch.empty_like(x)
    n = dist.get_world_size(group)
    row_bytes = x[:1].numel() * x.element_size()
    wire = x.shape[0] // n * (n - 1) * row_bytes           # every peer's equal piece but mine
    routed = f"routed_{kind}"
    setattr(traffic, routed, getattr(traffic, routed) + routed_rows * row_bytes)
    traffic.sent += wire                                   # what the wire carries, padding too
    with comm_span("all_to_all", wire):
        comm.all_to_all_single(out, x.contiguous(), group=group)
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

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, room: int | None,
                 experts: nn.ModuleDict) -> tuple:
        """x: [E, B, d], expert e's kept rows first, zero padding after (refimpl.model.moe_slots);
        counts: [E] kept rows per expert. Returns the outputs in x's layout and recv [ep, E/ep]."""
        n_experts, bound, d = x.shape
        me = dist.get_rank(self.ep_group)
        with phase("moe:dispatch"):
            recv = torch.empty_like(counts)
            with comm_span("all_to_all", counts.nbytes):
                self.comm.all_to_all_single(recv, counts, group=self.ep_group)
            recv = recv.view(self.ep, self.local)     # recv[s, j]: rows rank s sends my expert j
            sent, got = counts.view(self.ep, self.local).sum(dim=1), recv.sum(dim=1)
            to_others, from_others = sent.sum() - sent[me], got.sum() - got[me]
            rows = AllToAll.apply(x.reshape(n_experts * bound, d), self.ep_group, self.comm,
                                  self.traffic, "dispatch", (to_others, from_others))
            # each local expert's real rows, source after source, in a buffer of `room` rows
            room = self.ep * bound if room is None else min(room, self.ep * bound)
            dest = compact_destinations(recv, bound, room)
            packed = pack(rows, dest, self.local * room).view(self.local, room, d)
        with phase("moe:experts"):
            y = torch.stack([experts[str(self.first + j)](p) for j, p in enumerate(packed)])
            y = unpack(y.reshape(self.local * room, d), dest)   # back to the received layout
        with phase("moe:combine"):
            out = AllToAll.apply(y, self.ep_group, self.comm, self.traffic, "combine",
                                 (from_others, to_others))
        return out.view(n_experts, bound, d), recv


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
        layer.dispatch = SharedCounts(token_group, comm)
    return model


def is_expert_param(p: torch.Tensor) -> bool:
    return isinstance(placement_of(p), Owned)
