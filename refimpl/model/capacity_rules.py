"""Two ways to fill an expert's capacity: ours (global, batch order) and GShard/Switch's (per group,
first choices first).

Ours (refimpl.model.moe): C = ceil(k·T/E·cf) over the *whole* global batch, and an expert takes
assignments in batch order (token, then slot). The ranks all-gather their per-expert counts so
each knows its place in every expert's queue. It is an equivalence device: with it, an
expert-parallel run drops exactly the assignments `single` drops, so `ep` can be checked against
`single` to round-off (notebook 08 §4).

GShard (Lepikhin et al. 2020, §2.2 and Algorithm 1) and Switch Transformer (Fedus et al. 2021,
§2.1, eq. 3) split the tokens into G groups (in practice one per device) and give each expert a
capacity C_g = ceil(k·T_g/E·cf) *in each group*, with no communication before the dispatch. Within
a group every token's first choice is placed before any token's second choice (GShard's
Algorithm 1 fills the top-1 slots, then the top-2 with what is left), so a token loses its
second expert before any token loses its first (GShard also drops a second choice at random
in proportion to its small gate, "random routing"; not modelled here). The same tokens can then drop differently on a
different number of devices: the reason `ep` here does not use it.
"""
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
