"""What the MoE layers' all-to-alls sent, per step: counted beside the dispatch, not inside it.

    meter_experts(model)              # after the ep transform: each layer's dispatch, metered
    all_to_all_bytes(model)           # read and reset, once per step, after backward

`sent`: every byte this rank's token all-to-alls put on the wire to other ranks, the fixed-size
buffers whole, padding included ((ep-1)/ep of each [E, B] buffer, forward and backward).
`routed_dispatch`, `routed_combine`: the bytes of real rows among them (device tensors, counted
without a host read); `padding` the rest (refimpl.model.moe_slots).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from refimpl.model.moe import moe_layers
from refimpl.parallel.ep.dispatch import ExpertParallelDispatch


@dataclass
class Traffic:
    sent: int = 0
    routed_dispatch: int = 0
    routed_combine: int = 0


class MeteredDispatch(ExpertParallelDispatch):
    """ExpertParallelDispatch, its token all-to-alls counted as they run: two in forward (dispatch,
    combine), two in backward (hooks on the tensors whose gradients they send)."""

    def __init__(self, ep_group, token_group, n_experts: int):
        super().__init__(ep_group, token_group, n_experts)
        self.traffic = Traffic()

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, room, experts: nn.ModuleDict) -> tuple:
        out, recv = super().__call__(x, counts, room, experts)
        n, me = self.ep, self.first // self.local
        row = x.shape[-1] * x.element_size()
        wire = x.shape[0] * x.shape[1] // n * (n - 1) * row        # one all-to-all's, padding too
        sent, got = counts.view(n, self.local).sum(dim=1), recv.sum(dim=1)
        to_others, from_others = (sent.sum() - sent[me]) * row, (got.sum() - got[me]) * row
        t = self.traffic
        t.sent += 2 * wire
        t.routed_dispatch, t.routed_combine = t.routed_dispatch + to_others, t.routed_combine + from_others
        if out.requires_grad:        # combine's backward sends my tokens' gradients to the experts
            out.register_hook(lambda g: self._backward("routed_dispatch", wire, to_others))
        if x.requires_grad:          # dispatch's backward sends the experts' input gradients back
            x.register_hook(lambda g: self._backward("routed_combine", wire, from_others))
        return out, recv

    def _backward(self, kind: str, wire: int, rows) -> None:
        self.traffic.sent += wire
        setattr(self.traffic, kind, getattr(self.traffic, kind) + rows)


def meter_experts(model: nn.Module) -> nn.Module:
    """Every MoE layer whose experts are spread over ranks: its dispatch metered (in place)."""
    for layer in moe_layers(model):
        d = layer.dispatch
        if type(d) is ExpertParallelDispatch:
            layer.dispatch = MeteredDispatch(d.ep_group, d.token_group, d.n_experts)
    return model


def all_to_all_bytes(model: nn.Module, reset: bool = True) -> dict[str, int]:
    """What this rank's all-to-alls sent since the last reset, summed over the MoE layers (zero
    for local experts or an unmetered dispatch)."""
    total = Traffic()
    for layer in moe_layers(model):
        if isinstance(layer.dispatch, MeteredDispatch):
            t = layer.dispatch.traffic
            total.sent += t.sent
            total.routed_dispatch += t.routed_dispatch
            total.routed_combine += t.routed_combine
            if reset:   # in place: a pending backward's hook still holds this layer
                t.sent = t.routed_dispatch = t.routed_combine = 0
    routed = {"routed_dispatch": int(total.routed_dispatch), "routed_combine": int(total.routed_combine)}
    return {"sent": total.sent, **routed, "padding": total.sent - sum(routed.values())}


def moe_step_record(model: nn.Module) -> dict | None:
    """What the MoE layers did in the last forward, as plain lists for the loop's JSON result (None
    for a dense model); the all-to-all bytes are read and reset: call once per step, after backward."""
    layers = moe_layers(model)
    if not layers or layers[0].stats is None:
        return None
    return {"routed": [layer.stats.routed.tolist() for layer in layers],
            "kept": [layer.stats.kept.tolist() for layer in layers],
            "received": [layer.stats.received.tolist() for layer in layers],
            "dropped": [layer.stats.dropped for layer in layers],
            "capacity": layers[0].stats.capacity,
            "first_expert": layers[0].dispatch.first,
            "all_to_all_bytes": all_to_all_bytes(model)}
