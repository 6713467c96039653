"""Mixture of experts (Switch Transformer, Fedus et al. 2022): a router sends each token to k of E
expert MLPs; an expert takes at most C = ceil(k·T/E·capacity_factor) assignments, the rest drop."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from refimpl.model.config import GPTConfig
from refimpl.model.moe_routing import MoEStats, expert_capacity, route, switch_aux_loss, within_capacity
from refimpl.model.moe_sequence import WholeSequences, keep_per_sequence, sequence_aux_loss, sequence_tokens
from refimpl.model.moe_slots import destinations, one_hot, pack, unpack
from refimpl.model.parts import feed_forward
from refimpl.seam import phase


class _Recomputing:
    """Entered while activation checkpointing recomputes a block in backward."""
    depth = 0

    def __enter__(self):
        _Recomputing.depth += 1

    def __exit__(self, *exc):
        _Recomputing.depth -= 1


def recompute_contexts():
    """A checkpointed block's `context_fn`: its recomputation does not count into the load twice."""
    return contextlib.nullcontext(), _Recomputing()


class LocalExperts:
    """Every expert and every token in this process: the single-process reference's dispatch."""

    first = 0          # the global index of this rank's first expert

    def gather_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Counts per expert of every token-holding rank ([ranks, E]) and this rank's row."""
        return counts[None], 0

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, room: int | None,
                 experts: nn.ModuleDict) -> tuple:
        """x: [E, B, d], expert e's kept rows first, zero padding after: the experts' outputs in
        that layout and the rows each processed ([1, E]). Padding included, no gradient is None."""
        return torch.stack([experts[str(e)](part) for e, part in enumerate(x)]), counts[None]


class MoEMLP(nn.Module):
    """Router + E experts keyed by global index (`experts.2` on any rank). After a forward:
    `aux_loss` (0 unless balance=aux), `stats` (MoEStats), `keep` ([T, k] kept or not)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): feed_forward(cfg) for e in range(cfg.n_experts)})
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.dispatch = LocalExperts()
        self.sequences = WholeSequences()   # cp replaces it (parallel.ep.counts.ChunkedSequences)
        self.aux_loss = torch.zeros(())
        self.stats: MoEStats | None = None
        self.keep: torch.Tensor | None = None
        self.step_load: torch.Tensor | None = None   # routed, summed over this step's forwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, tokens = x.shape, x.reshape(-1, x.shape[-1])
        E, k = self.n_experts, self.top_k
        with phase("moe:router"):
            bias = self.expert_bias if self.cfg.balance == "bias" else None
            r = route(self.router(tokens), k, bias)
            flat = r.experts.reshape(-1)                 # assignment a = (token a // k, slot a % k)
            if self.cfg.capacity_scope == "sequence":
                keep, routed, kept, capacity, aux, bound, room = self._fill_per_sequence(
                    flat, r.probs, shape[0] if x.dim() == 3 else 1)
            else:
                keep, routed, kept, capacity, aux, bound, room = self._fill_batch(flat, r.probs)
            self.aux_loss = aux if self.cfg.balance == "aux" else tokens.new_zeros(())
            if torch.is_grad_enabled() and not _Recomputing.depth:   # a training forward, once
                self.step_load = routed if self.step_load is None else self.step_load + routed
            # each kept assignment's row in a fixed [E, B] buffer (refimpl.model.moe_slots)
            kept_hot = one_hot(flat, E) * keep[:, None]
            dest = destinations(flat, keep, kept_hot, bound)
            counts = kept_hot.sum(dim=0)                               # kept, per expert
            token_of = torch.arange(flat.numel(), device=flat.device) // k
            rows = pack(tokens, dest, E * bound, row_of=token_of)
        y, received = self.dispatch(rows.view(E, bound, -1), counts, room, self.experts)
        self.stats = MoEStats(routed, kept, capacity, received)
        self.keep = keep.view(-1, k)
        y = unpack(y.reshape(E * bound, -1), dest)     # a dropped assignment reads a zero row
        weighted = y * r.gates.reshape(-1)[:, None]    # (under bf16 autocast the experts' dtype)
        return weighted.view(tokens.shape[0], k, -1).sum(dim=1).view(shape)

    def _fill_batch(self, flat: torch.Tensor, probs: torch.Tensor) -> tuple:
        """capacity_scope=batch: C over the forward's tokens on every token-holding rank, queued in
        batch order (a rank's after the ranks before it)."""
        E, k = self.n_experts, self.top_k
        counts_by_rank, me = self.dispatch.gather_counts(one_hot(flat, E).sum(dim=0))
        routed = counts_by_rank.sum(dim=0)
        # T from shapes (every token-holding rank holds as many): no read of routed.sum()
        local = flat.numel() // k
        capacity = expert_capacity(counts_by_rank.shape[0] * local, E, k, self.cfg.capacity_factor)
        keep = within_capacity(flat, E, counts_by_rank[:me].sum(dim=0), capacity)
        aux = switch_aux_loss(probs, routed, self.cfg.aux_alpha) if self.cfg.balance == "aux" else None
        # B: an expert gets at most C from all ranks together, at most one per token from mine
        return keep, routed, routed.clamp(max=capacity), capacity, aux, min(capacity, local), capacity

    def _fill_per_sequence(self, flat: torch.Tensor, probs: torch.Tensor, rows: int) -> tuple:
        """capacity_scope=sequence (refimpl.model.moe_sequence): C and f_i per sequence; the loads
        gathered over the token-holding ranks (one all-gather of [2, E])."""
        E, k = self.n_experts, self.top_k
        seq = sequence_tokens(flat.numel() // k, rows, self.sequences)
        capacity = expert_capacity(seq, E, k, self.cfg.capacity_factor)
        keep, per_sequence = keep_per_sequence(flat, rows, E, capacity, self.sequences)
        hot = one_hot(flat, E)
        loads, _ = self.dispatch.gather_counts(torch.stack([hot.sum(0), (hot * keep[:, None]).sum(0)]))
        routed, kept = loads.sum(dim=0)
        aux = (sequence_aux_loss(probs, per_sequence, k, seq, self.cfg.aux_alpha)
               if self.cfg.balance == "aux" else None)
        # B: C per sequence of my `rows`, at most one per token; no tighter total than ep * B
        return keep, routed, kept, capacity, aux, min(rows * capacity, flat.numel() // k), None

    @torch.no_grad()
    def update_bias(self) -> None:
        """DeepSeek-V3: b_i -= gamma * sign(load_i - mean), the load summed over the step's forwards
        (each global already), so micro-batching and the layout do not change it."""
        load, self.step_load = self.step_load, None
        if self.cfg.balance != "bias" or load is None:
            return
        load = load.to(self.expert_bias.dtype)
        self.expert_bias -= self.cfg.bias_gamma * torch.sign(load - load.mean())


# --- what the training loop calls -------------------------------------------------------------------

def moe_layers(model: nn.Module) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the MoE layers' auxiliary losses from the last forward (0.0 for a dense model)."""
    return sum((layer.aux_loss for layer in moe_layers(model)), 0.0)


def update_expert_bias(model: nn.Module) -> None:
    """After the optimizer step: nudge every layer's bias (balance=bias; a no-op otherwise)."""
    for layer in moe_layers(model):
        layer.update_bias()
