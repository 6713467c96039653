"""The MoE router: top-k gating, the capacity and the load-balancing loss."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from refimpl.model.moe_slots import one_hot


@dataclass(frozen=True)
class Routing:
    """The router's decision for T tokens: `experts[t, j]` is token t's j-th choice."""
    experts: torch.Tensor   # [T, k] long
    gates: torch.Tensor     # [T, k] weights of the chosen experts' outputs (differentiable)
    probs: torch.Tensor     # [T, E] softmax of the router logits (differentiable)


def route(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None) -> Routing:
    """Top-k gating. `bias` (DeepSeek-V3) shifts the choice, never the gate values."""
    # At least fp32 (bf16 logits under autocast are widened), float64 kept as it is.
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
    scores = probs.detach() if bias is None else probs.detach() + bias
    # A stable descending sort keeps equal scores in index order: deterministic tie-breaking.
    chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    picked = probs.gather(1, chosen)
    gates = picked if top_k == 1 else picked / picked.sum(dim=-1, keepdim=True)
    return Routing(chosen, gates.to(logits.dtype), probs)


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """C = ceil(k * T / E * capacity_factor): the most assignments one expert takes per forward."""
    return math.ceil(top_k * n_tokens / n_experts * capacity_factor)


def within_capacity(experts_flat: torch.Tensor, n_experts: int, offsets: torch.Tensor,
                    capacity: int) -> torch.Tensor:
    """Which assignments fit: an assignment's place in its expert's queue counts the earlier ones
    (`offsets`: the ranks' before this one, then this rank's in batch order); >= capacity drop."""
    place = one_hot(experts_flat, n_experts).cumsum(dim=0) - 1 + offsets
    return place.gather(1, experts_flat[:, None]).squeeze(1) < capacity


def switch_aux_loss(probs: torch.Tensor, routed: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * E * sum_i f_i * P_i (Switch eq. 4): f from the global counts `routed`, P this rank's
    mean, so the mean of the ranks' losses is the global loss."""
    n_experts = probs.shape[1]
    f = routed.to(probs.dtype) / routed.sum()
    return alpha * n_experts * (f * probs.mean(dim=0)).sum()


@dataclass(frozen=True)
class MoEStats:
    """What one forward of one MoE layer did, for the whole global batch (every rank agrees)."""
    routed: torch.Tensor    # [E] assignments the router sent to each expert
    kept: torch.Tensor      # [E] assignments each expert processed (<= capacity)
    capacity: int
    received: torch.Tensor  # [source ranks, E_local] rows this rank's experts got from each rank

    @property
    def dropped(self) -> int:
        return int((self.routed - self.kept).sum())
