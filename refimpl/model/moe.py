"""Mixture of experts: the MLP that a router splits into E experts, k of them active per token.

Seed (001, 전문가 병렬화): a router (게이팅 네트워크) sends each token to a few expert networks, so
the parameter count grows with E while the compute per token grows only with k. Seed (003): the
hard part is load balancing (로드 밸런싱) -- a router that favours a few experts leaves the others,
and the devices holding them, idle.

One MoE layer, top to bottom (the numbers are the papers' formulas):

  router      logits = x W_r (no bias), probabilities p = softmax(logits) over the E experts.
  top-k       choose the k largest scores per token (k = 1: Switch Transformer, Fedus et al. 2021;
              k = 2: GShard, Lepikhin et al. 2020). Ties go to the lower expert index (a stable
              sort), so every layout picks the same experts for the same scores.
  gates       k = 1: the gate is p itself (Switch, section 2.1: the router learns through it);
              k > 1: p renormalised over the chosen experts (GShard, Mixtral).
  capacity    C = ceil(k * T / E * capacity_factor) (Switch, eq. 3 with GShard's k*T slots for
              top-k; T = tokens in one forward of the whole batch: the global batch, or one
              micro-batch of it). An expert takes assignments in batch order (token, then slot)
              until it holds C; the rest overflow: they skip the expert and the token keeps only
              its residual path (Block adds x back). Overflows are counted.
  aux loss    Switch, eq. 4-6: alpha * E * sum_i f_i P_i, with f_i the fraction of assignments
              routed to expert i (a count, no gradient) and P_i the mean router probability of
              expert i (differentiable). Minimal (= alpha) when the load is uniform.
  bias        DeepSeek-V3 (Liu et al. 2024, section 2.1.2, auxiliary-loss-free balancing): a
              per-expert bias b_i is added to the scores *for choosing only* (gates still come from
              p); at the end of each step b_i moves by -gamma if expert i was overloaded, +gamma if
              under, the load being the whole step's (every micro-batch's tokens, on every rank).

`--set balance=aux|bias|none` picks the balancing: aux (the default) adds the loss, bias nudges,
none does neither (the load then drifts: notebook 08 shows it).

The layer only *routes*; who runs the experts is its `dispatch`: `LocalExperts` here (every expert
on this process), or refimpl.parallel.ep.dispatch's all-to-all over an ep group. Both receive
the assignments sorted by expert and in global batch order, so a layout never changes the maths.
The capacity and f_i are global (counts gathered over the ranks that hold tokens): that is what
makes an expert-parallel run drop exactly the tokens the single process drops.

No host read. C comes from the batch's shape (the routed count is k*T, every token-holding rank
holding as many tokens), so the kept assignments travel in buffers of a size known before the
step (refimpl.model.moe_slots: each expert's slots, padded with zero rows that change no
gradient); counts, stats and the aux loss stay on the device. `MoEStats`'s `dropped` and
`imbalance` and the all-to-all byte counters are host reads, made only after the step
(`moe_step_record`, notebooks). Every rule here has a capacity (capacity_factor > 0): there is no
dropless mode, which could not have fixed sizes (its buffers would be the routed counts).

Scope (`--set capacity_scope=batch|sequence`). `batch`, the default, is the rule above: C and f_i
over one forward's tokens, in batch order. It equals single only where a forward holds single's
tokens in single's order; data parallelism with micro-batches (a forward holds the i-th
micro-batch of each rank's rows) and context parallelism (a rank holds two chunks of each
sequence) break that, and `batch_scope_problem` refuses them before launch unless nothing can
overflow (capacity_factor >= E/k) and, for the first, balance != aux. `sequence` counts C and the
aux loss per sequence (refimpl.model.moe_sequence, DeepSeek-V3's sequence-wise balance loss): a
sequence is the same in every layout, so every layout equals single under it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from refimpl.labels import phase
from refimpl.model.config import GPTConfig
from refimpl.model.moe_layout import BALANCE, SCOPES, batch_scope_problem, validate_moe  # noqa: F401
from refimpl.model.moe_sequence import (
    WholeSequences,
    keep_per_sequence,
    sequence_aux_loss,
    sequence_tokens,
)
from refimpl.model.moe_slots import destinations, one_hot, pack, unpack
from refimpl.model.parts import feed_forward


class _Recompute:
    depth = 0    # > 0 while activation checkpointing recomputes a block in backward


@contextlib.contextmanager
def _recomputing():
    _Recompute.depth += 1
    try:
        yield
    finally:
        _Recompute.depth -= 1


def recompute_contexts():
    """torch.utils.checkpoint's `context_fn` for a block (refimpl.model.gpt): the recomputation in
    backward runs inside `_recomputing`, so it does not count its tokens into the step's load twice."""
    return contextlib.nullcontext(), _recomputing()


@dataclass(frozen=True)
class Routing:
    """The router's decision for T tokens: `experts[t, j]` is token t's j-th choice."""
    experts: torch.Tensor   # [T, k] long
    gates: torch.Tensor     # [T, k] weights of the chosen experts' outputs (differentiable)
    probs: torch.Tensor     # [T, E] softmax of the router logits (differentiable)


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

    @property
    def imbalance(self) -> float:
        """max / mean of the routed load: 1.0 is perfect balance, E means one expert takes all."""
        return float(self.routed.max() / self.routed.float().mean())


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
    """Which assignments fit: an assignment's place in its expert's queue is the number of earlier
    assignments to that expert (`offsets`: those of the ranks before this one; then this rank's,
    in batch order). Places >= capacity overflow."""
    place = one_hot(experts_flat, n_experts).cumsum(dim=0) - 1 + offsets
    return place.gather(1, experts_flat[:, None]).squeeze(1) < capacity


def switch_aux_loss(probs: torch.Tensor, routed: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * E * sum_i f_i * P_i (Switch eq. 4). `routed` are the global counts, so f is the
    global fraction; P is this rank's mean, so the mean of the ranks' losses is the global loss."""
    n_experts = probs.shape[1]
    f = routed.to(probs.dtype) / routed.sum()
    return alpha * n_experts * (f * probs.mean(dim=0)).sum()


@dataclass
class Traffic:
    """What this rank's expert-parallel all-to-alls sent to other ranks since the last reset (a
    local dispatch sends nothing). `sent`: every byte on the wire, the fixed-size buffers whole,
    padding included (known from the shapes). `routed_dispatch`, `routed_combine`: the bytes of
    real rows among them, per all-to-all kind (device tensors, counted without a host read).
    What the wire carries beyond the routed rows is padding (`all_to_all_bytes`)."""
    sent: int = 0
    routed_dispatch: int = 0
    routed_combine: int = 0


class LocalExperts:
    """Every expert lives in this process, and so does every token: the single-process
    reference's dispatch. (A data-parallel replica's counts the other ranks' tokens too:
    refimpl.parallel.ep.counts.SharedCounts.)"""

    first = 0          # the global index of this rank's first expert

    def __init__(self):
        self.traffic = Traffic()

    def gather_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Counts per expert of every token-holding rank ([ranks, E]) and this rank's row."""
        return counts[None], 0

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, room: int | None,
                 experts: nn.ModuleDict) -> tuple:
        """x: [E, B, d], expert e's kept assignments in its first counts[e] rows, zero padding
        after them (refimpl.model.moe_slots). Returns the experts' outputs in the same layout, and
        the rows each of this rank's experts processed, per source rank ([1, E]). `room` (the
        most rows one expert gets in all) matters only to an expert-parallel dispatch."""
        # Every expert runs on its B rows (padding included), so its gradient is never None.
        return torch.stack([experts[str(e)](part) for e, part in enumerate(x)]), counts[None]


class MoEMLP(nn.Module):
    """The MLP of a block when cfg.n_experts > 0: router + E experts (each the dense MLP's shape).

    Parameter names: `router.weight`, `experts.<e>.up.weight`, ... (a ModuleDict keyed by the
    expert's global index, so an expert-parallel rank that keeps experts 2 and 3 still calls them
    `experts.2`, `experts.3`). Buffer `expert_bias` (DeepSeek-V3's b, zero unless balance=bias).
    After a forward: `aux_loss` (0 unless balance=aux), `stats` (MoEStats), `keep` ([T, k] which of
    this rank's assignments reached their expert).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.balance not in BALANCE:
            raise ValueError(f"balance must be one of {BALANCE} (got {cfg.balance!r})")
        if cfg.capacity_scope not in SCOPES:
            raise ValueError(f"capacity_scope must be one of {SCOPES} (got {cfg.capacity_scope!r})")
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        # each expert the dense feed-forward layer's shape: GELU MLPs, or Mixtral's SwiGLUs
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
            if torch.is_grad_enabled() and not _Recompute.depth:   # a training forward, once
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
        """capacity_scope=batch: C over the forward's tokens on every token-holding rank, each
        rank's place in an expert's queue after the ranks before it (batch order)."""
        E, k = self.n_experts, self.top_k
        counts_by_rank, me = self.dispatch.gather_counts(one_hot(flat, E).sum(dim=0))
        routed = counts_by_rank.sum(dim=0)
        # T from shapes: every token-holding rank holds as many tokens (the batch divides evenly
        # over dp x cp), so routed.sum() is k * T without reading it
        local = flat.numel() // k
        capacity = expert_capacity(counts_by_rank.shape[0] * local, E, k, self.cfg.capacity_factor)
        keep = within_capacity(flat, E, counts_by_rank[:me].sum(dim=0), capacity)
        aux = switch_aux_loss(probs, routed, self.cfg.aux_alpha) if self.cfg.balance == "aux" else None
        # B: an expert gets at most C from all ranks together, at most one per token from mine
        return keep, routed, routed.clamp(max=capacity), capacity, aux, min(capacity, local), capacity

    def _fill_per_sequence(self, flat: torch.Tensor, probs: torch.Tensor, rows: int) -> tuple:
        """capacity_scope=sequence (refimpl.model.moe_sequence): C and f_i per sequence; the
        routed and kept loads are then gathered over the token-holding ranks for the stats and
        the bias (one all-gather of [2, E], as the batch scope's)."""
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
        """DeepSeek-V3's nudge from the step's load: b_i -= gamma * sign(load_i - mean), the load
        summed over every forward of the step (each already global over the token-holding ranks),
        so micro-batching and the layout do not change it."""
        load, self.step_load = self.step_load, None
        if self.cfg.balance != "bias" or load is None:
            return
        load = load.to(self.expert_bias.dtype)
        self.expert_bias -= self.cfg.bias_gamma * torch.sign(load - load.mean())


# --- what the training loop calls -------------------------------------------------------------------

def moe_layers(model: nn.Module) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the MoE layers' auxiliary losses from the last forward (0.0 for a dense model).
    The loop adds it to the language-model loss before backward."""
    layers = moe_layers(model)
    return sum(layer.aux_loss for layer in layers) if layers else 0.0


def update_expert_bias(model: nn.Module) -> None:
    """After the optimizer step: nudge every layer's bias (balance=bias; a no-op otherwise)."""
    for layer in moe_layers(model):
        layer.update_bias()


def moe_step_record(model: nn.Module) -> dict | None:
    """What the MoE layers did in the last forward, as plain lists for the loop's JSON result
    (None for a dense model). The expert-parallel all-to-all byte counters are read and reset:
    call once per step, after backward (the backward's all-to-alls are counted too)."""
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


def all_to_all_bytes(model: nn.Module, reset: bool = True) -> dict[str, int]:
    """Bytes this rank's expert-parallel all-to-alls (dispatch and combine, forward and backward)
    sent to other ranks since the last reset, summed over the MoE layers (zero for local experts):
    `sent`, everything on the wire; `routed_dispatch` + `routed_combine`, the real rows among
    them; `padding`, the rest (the empty slots of the fixed-size buffers, refimpl.model.moe_slots)."""
    total = Traffic()
    for layer in moe_layers(model):
        t = layer.dispatch.traffic
        total.sent += t.sent
        total.routed_dispatch += t.routed_dispatch
        total.routed_combine += t.routed_combine
        if reset:   # in place: a pending backward still holds this object
            t.sent = t.routed_dispatch = t.routed_combine = 0
    # the routed counts are device tensors (rows counted without a host read): read here
    routed = {"routed_dispatch": int(total.routed_dispatch), "routed_combine": int(total.routed_combine)}
    return {"sent": total.sent, **routed, "padding": total.sent - sum(routed.values())}
