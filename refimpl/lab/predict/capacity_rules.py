"""Two ways to fill an expert's capacity: ours (global, batch order) and GShard/Switch's (per group,
first choices first)."""
from __future__ import annotations

import torch

from refimpl.model.moe import expert_capacity, within_capacity


def per_group_keep(experts: torch.Tensor, n_experts: int, capacity_factor: float, groups: int) -> torch.Tensor:
    """[T, k] bool: which of the router's choices (`experts`, [T, k]) reach their expert under the
    per-group rule: T tokens in `groups` equal consecutive groups, C_g per expert per group, the
    group's slot-0 choices queued before its slot-1 choices, each slot in token order."""
    tokens, k = experts.shape
    if tokens % groups:
        raise ValueError(f"{tokens} tokens do not split into {groups} equal groups")
    per = tokens // groups
    capacity = expert_capacity(per, n_experts, k, capacity_factor)
    keep = torch.zeros_like(experts, dtype=torch.bool)
    for g in range(groups):
        block = experts[g * per:(g + 1) * per]
        queue = block.t().reshape(-1)                      # slot-major: every first choice, then seconds
        place = torch.nn.functional.one_hot(queue, n_experts).cumsum(dim=0) - 1
        fits = place.gather(1, queue[:, None]).squeeze(1) < capacity
        keep[g * per:(g + 1) * per] = fits.view(k, per).t()
    return keep


def global_keep(experts: torch.Tensor, n_experts: int, capacity_factor: float) -> torch.Tensor:
    """[T, k] bool under ours: one capacity for all T tokens, assignments in batch order."""
    tokens, k = experts.shape
    capacity = expert_capacity(tokens, n_experts, k, capacity_factor)
    flat = experts.reshape(-1)
    return within_capacity(flat, n_experts, torch.zeros(n_experts, dtype=torch.long), capacity).view(tokens, k)


def displaced_first_choices(experts: torch.Tensor, keep: torch.Tensor, groups: int = 1) -> int:
    """First choices dropped at an expert that, in the same group, kept somebody's later choice:
    zero under GShard's slot-major filling, possibly not under batch order."""
    tokens, k = experts.shape
    per, n = tokens // groups, 0
    for g in range(groups):
        e, kp = experts[g * per:(g + 1) * per], keep[g * per:(g + 1) * per]
        later_kept = set(e[:, 1:][kp[:, 1:]].tolist())
        n += sum(int(x) in later_kept for x in e[:, 0][~kp[:, 0]].tolist())
    return n
