"""The seed's section 2.2 table, computed: what each parallel strategy sends per training step."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from refimpl.cost.alpha_beta import predict_seconds
from refimpl.cost.collective_bytes import sent_per_rank
from refimpl.model.moe import expert_capacity

# The seed's qualitative columns (frequency, bottleneck), in English with the Korean beside.
BOTTLENECK = {
    "DP": "all-reduce time (All-Reduce 시간)",
    "ZeRO-3 / FSDP": "re-gathering parameters (메모리 재구성 오버헤드)",
    "TP": "frequent collectives (빈번한 집합 통신 호출)",
    "PP": "pipeline bubble, stage sync (파이프라인 버블, 스테이지 간 동기화)",
}


@dataclass(frozen=True)
class TrainingShape:
    """The sizes the communication volume depends on."""

    name: str
    n_params: int          # Psi
    n_layers: int          # L (transformer blocks)
    hidden: int            # h
    seq_len: int           # s
    micro_batch: int       # b, sequences per micro-batch
    n_micro_batches: int = 1  # m, micro-batches per step (gradient accumulation / pipeline)
    bytes_per_value: int = 2  # B: 2 for bf16/fp16 gradients and activations, 4 for fp32

    @property
    def param_bytes(self) -> int:
        return self.n_params * self.bytes_per_value

    @property
    def activation_bytes(self) -> int:
        """One layer-boundary activation of one micro-batch: b * s * h values."""
        return self.micro_batch * self.seq_len * self.hidden * self.bytes_per_value


# Llama-2-7B's shape (Touvron et al. 2023, "Llama 2", and its released config): 6.74e9 parameters,
# 32 layers, hidden 4096, context 4096; bf16 gradients and activations.
LLAMA_7B = TrainingShape("7B (Llama-2-7B shape)", n_params=6_738_415_616, n_layers=32, hidden=4096,
                         seq_len=4096, micro_batch=1, n_micro_batches=8, bytes_per_value=2)


def strategy_traffic(shape: TrainingShape, n: int) -> list[dict]:
    """Per strategy: the calls one step makes (op, message bytes, count) and bytes sent per rank."""
    psi_b, act, L, m = shape.param_bytes, shape.activation_bytes, shape.n_layers, shape.n_micro_batches
    return [
        {"strategy": "DP", "operations": "all_reduce", "frequency": "once per (accumulated) step",
         "calls": [("all_reduce", psi_b, 1)],
         "sent_per_rank": sent_per_rank("all_reduce", n, psi_b)},
        {"strategy": "ZeRO-3 / FSDP", "operations": "all_gather, reduce_scatter",
         "frequency": "per layer, in forward and in backward",
         "calls": [("all_gather", psi_b / L, 2 * L), ("reduce_scatter", psi_b / L, L)],
         "sent_per_rank": 3 * sent_per_rank("all_gather", n, psi_b)},
        {"strategy": "TP", "operations": "all_reduce (+ all_gather, reduce_scatter with SP)",
         "frequency": "4 per layer per micro-batch",
         "calls": [("all_reduce", act, 4 * L * m)],
         "sent_per_rank": 4 * L * m * sent_per_rank("all_reduce", n, act)},
        {"strategy": "PP", "operations": "send / recv",
         "frequency": "2 per micro-batch per stage boundary",
         "calls": [("send_recv", act, 2 * m)],
         "sent_per_rank": 2 * m * sent_per_rank("send_recv", n, act)},
    ]


def call_seconds(calls, fits: pd.DataFrame, n: int, impl: str = "torch") -> float:
    """Sum over calls of count * (alpha + M / beta), with the fit of that op on n ranks."""
    total = 0.0
    for op, message, count in calls:
        row = fits[(fits.op == op) & (fits.world_size == n) & (fits.impl == impl)]
        if row.empty:
            return float("nan")
        alpha, beta = float(row.alpha_s.iloc[0]), float(row.beta_bytes_per_s.iloc[0])
        total += count * float(predict_seconds(alpha, beta, message))
    return total


def cost_table(shape: TrainingShape, n: int, fits: pd.DataFrame | None = None,
               impl: str = "torch") -> pd.DataFrame:
    """The seed's 2.2 table for `shape` on `n` ranks, with numbers instead of adjectives.

    Columns: strategy, operations, message_bytes (one call), calls_per_step, frequency,
    sent_per_rank_bytes, predicted_s (when alpha-beta `fits` are given), bottleneck.
    """
    rows = []
    for t in strategy_traffic(shape, n):
        row = {"strategy": t["strategy"], "operations": t["operations"],
               "message_bytes": max(message for _, message, _ in t["calls"]),
               "calls_per_step": sum(count for _, _, count in t["calls"]),
               "frequency": t["frequency"], "sent_per_rank_bytes": t["sent_per_rank"]}
        if fits is not None:
            row["predicted_s"] = call_seconds(t["calls"], fits, n, impl)
        row["bottleneck"] = BOTTLENECK[t["strategy"]]
        rows.append(row)
    return pd.DataFrame(rows)


def ep_traffic(tokens_per_rank: int, hidden: int, n_layers: int, top_k: int, ep: int,
               bytes_per_value: int = 4, capacity_fraction: float = 1.0) -> dict:
    """Expert parallelism's row of the table (GShard, Lepikhin et al. 2020, section 3.2).

    Per MoE layer and step: a dispatch and a combine all-to-all in the forward, the same two
    reversed in the backward, each moving one rank's k*T kept rows of h values (M bytes, the
    all-to-all's message as nccl-tests defines it); with routing spread evenly over the ep experts'
    owners, (ep-1)/ep of them leave the rank. `capacity_fraction`: share of rows not dropped.
    """
    message = top_k * tokens_per_rank * capacity_fraction * hidden * bytes_per_value
    calls = 4 * n_layers
    return {"strategy": "EP", "operations": "all_to_all (dispatch, combine)",
            "frequency": "4 per MoE layer per micro-batch",
            "calls": [("all_to_all", message, calls)],
            "sent_per_rank": calls * sent_per_rank("all_to_all", ep, message)}


def ep_buffer_bytes(tokens_per_rank: int, token_ranks: int, n_experts: int, top_k: int,
                    capacity_factor: float, hidden: int, n_layers: int, ep: int,
                    bytes_per_value: int = 4) -> dict:
    """What refimpl's fixed-size dispatch puts on the wire per rank and step (batch capacity scope).

    Each all-to-all sends the whole [E, B] buffer, B = min(C, T_rank) rows per expert (C =
    ceil(k*T/E * cf) over the T tokens of all `token_ranks`; refimpl.model.moe_slots: an expert
    takes at most C in all, at most one row per token from one rank), of which (ep-1)/ep goes to
    other ranks; 4 all-to-alls per MoE layer and step (dispatch, combine, both reversed in
    backward). `buffer rows` against k*T_rank real rows at most: the rest is padding. Each rank's
    experts then run on fixed buffers too, min(C, ep*B) rows per expert whatever they received
    (refimpl.parallel.ep.dispatch: `room`): `expert rows / rank`.
    """
    capacity = expert_capacity(token_ranks * tokens_per_rank, n_experts, top_k, capacity_factor)
    bound = min(capacity, tokens_per_rank)
    rows = n_experts * bound
    per_call = rows * (ep - 1) // ep * hidden * bytes_per_value
    return {"capacity": capacity, "rows per expert (B)": bound, "buffer rows": rows,
            "routed rows at most": top_k * tokens_per_rank, "sent_per_rank": 4 * n_layers * per_call,
            "expert rows / rank": n_experts // ep * min(capacity, ep * bound)}
