"""The seed's MoE point in numbers: many parameters, few of them active per token."""
from __future__ import annotations

from dataclasses import dataclass, replace

from refimpl.model import GPTConfig, build_model, count_params


@dataclass(frozen=True)
class MoECount:
    name: str
    total_params: int
    active_params: int          # parameters a token touches (embedding row included)
    forward_flops_per_token: int

    @property
    def total_over_active(self) -> float:
        return self.total_params / self.active_params


# --- the workbook's GPT -----------------------------------------------------------------------------

def gpt_counts(cfg: GPTConfig, context: int) -> MoECount:
    """Exact parameter count of refimpl.model.GPT(cfg) and its forward FLOPs per token at `context`."""
    d, L, V, width = cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.mlp_ratio * cfg.d_model
    attention = 4 * d * d + 3 * d                    # q, k, v, o; biases on q, v, o (not on k)
    norms = 2 * 2 * d                                # ln1, ln2: weight and bias
    expert = 2 * d * width + width + d               # up, down, their biases
    experts, active = (cfg.n_experts, cfg.top_k) if cfg.n_experts else (1, 1)
    router = d * cfg.n_experts
    per_layer = attention + norms + router
    embed = V * d + cfg.seq_len * d
    head = 0 if cfg.tie_embeddings else V * d
    total = embed + L * (per_layer + experts * expert) + 2 * d + head
    active_params = embed + L * (per_layer + active * expert) + 2 * d + head
    matmul = L * (4 * d * d + router + active * 2 * d * width) + V * d
    flops = 2 * matmul + L * 2 * 2 * context * d
    return MoECount(f"GPT d={d} L={L} E={cfg.n_experts} k={cfg.top_k}", total, active_params, flops)


def dense_twin(cfg: GPTConfig) -> GPTConfig:
    """The dense model of the same active size: one MLP as wide as the k active experts together."""
    if not cfg.n_experts:
        raise ValueError("dense_twin needs an MoE config (n_experts > 0)")
    from dataclasses import replace

    return replace(cfg, n_experts=0, mlp_ratio=cfg.mlp_ratio * cfg.top_k)


def measured_forward_flops(model, idx) -> int:
    """Floating-point operations of one forward, counted by PyTorch's FlopCounterMode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(idx)
    return counter.get_total_flops()


# --- published MoE models -----------------------------------------------------------------------------

def _swiglu(d: int, width: int) -> int:
    return 3 * d * width                              # gate, up, down; no biases


def mixtral_8x7b() -> MoECount:
    d, L, V, width, E, k = 4096, 32, 32000, 14336, 8, 2
    heads, kv_heads, head_dim = 32, 8, 128
    attention = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2   # q, o; k, v
    per_layer_fixed = attention + d * E + 2 * d        # + router + two RMSNorms
    total = 2 * V * d + d + L * (per_layer_fixed + E * _swiglu(d, width))
    active = 2 * V * d + d + L * (per_layer_fixed + k * _swiglu(d, width))
    flops = 2 * (active - V * d)                      # the input embedding is a lookup
    return MoECount("Mixtral 8x7B", total, active, flops)


def deepseek_v3() -> MoECount:
    d, L, V, dense_layers, dense_width = 7168, 61, 129280, 3, 18432
    E, shared, k, width = 256, 1, 8, 2048
    heads, q_rank, kv_rank, nope, rope, v_dim = 128, 1536, 512, 128, 64, 128
    attention = (d * q_rank + q_rank + q_rank * heads * (nope + rope)        # q down, norm, q up
                 + d * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)  # kv
                 + heads * v_dim * d)                                        # o
    fixed = L * (attention + 2 * d) + 2 * V * d + d
    dense = dense_layers * _swiglu(d, dense_width)
    moe_layers = L - dense_layers
    router = d * E + E                                 # weights + the balancing bias
    total = fixed + dense + moe_layers * (router + (E + shared) * _swiglu(d, width))
    active = fixed + dense + moe_layers * (router + (k + shared) * _swiglu(d, width))
    flops = 2 * (active - V * d)
    return MoECount("DeepSeek-V3", total, active, flops)


PUBLISHED = {"Mixtral 8x7B": (mixtral_8x7b, 46.7e9, 12.9e9),
             "DeepSeek-V3": (deepseek_v3, 671e9, 37e9)}


def published_table():
    """One row per published model: computed total/active vs the paper's figures."""
    import pandas as pd

    rows = []
    for name, (fn, total, active) in PUBLISHED.items():
        c = fn()
        rows.append({"model": name, "total_params": c.total_params, "paper_total": total,
                     "active_params": c.active_params, "paper_active": active,
                     "total_over_active": c.total_over_active,
                     "forward_gflops_per_token": c.forward_flops_per_token / 1e9})
    return pd.DataFrame(rows)


def dense_comparison(cfg: GPTConfig, context: int, batch: int = 2, seed: int = 0):
    """The MoE `cfg` and its dense twin side by side: parameters counted on the built model and by
    `gpt_counts`, FLOPs per token counted by FlopCounterMode on a forward and by the formula.

    The forward is counted at capacity factor 1: the MoE layer runs each expert on a fixed buffer
    of C = k*T/E rows (refimpl.model.moe_slots: padding where fewer came), so its experts multiply
    E*C = k*T rows, the formula's k per token; a factor cf multiplies the experts' FLOPs by cf
    (Switch, Fedus et al. 2021, sec. 2.1: the capacity buys fewer drops with compute)."""
    import pandas as pd
    import torch

    idx = torch.zeros(batch, context, dtype=torch.long)
    if cfg.n_experts:
        cfg = replace(cfg, capacity_factor=1.0)
    rows = []
    for name, c in ((f"MoE E={cfg.n_experts}, k={cfg.top_k}", cfg),
                    (f"dense twin (MLP {cfg.top_k}x wider)", dense_twin(cfg))):
        model, formula = build_model(c, seed), gpt_counts(c, context=context)
        rows.append({"model": name, "params": count_params(model), "formula params": formula.total_params,
                     "active params": formula.active_params,
                     "FLOPs/token (counted)": measured_forward_flops(model, idx) / idx.numel(),
                     "FLOPs/token (formula)": formula.forward_flops_per_token})
    return pd.DataFrame(rows).set_index("model")
