"""Enumerate every layout of a model on a cluster, predict each, rank them (seed 001: Alpa and
FlexFlow search such spaces automatically; this is the exhaustive, explainable version).

    plan(n_layers=80, d_model=8192, n_heads=64, vocab_size=32000, seq_len=4096,
         global_batch=1024, gpus=64)          # -> DataFrame, fastest fitting layout first

A layout is (dp, tp, pp, cp) with dp·tp·pp·cp = gpus, a ZeRO stage, a micro-batch size, activation
recomputation and sequence parallelism. The rules that make a layout impossible (not merely slow):
heads divisible by tp, layers by pp, the sequence by 2·cp (ring attention's head-tail chunks), the
global batch by dp × micro-batch size. What does not fit in memory is kept and marked fits=False.
A mixture of experts adds ep, every size that divides dp × cp (refimpl.mesh: ep reuses the
data-parallel ranks) and the expert count; a dense model has ep = 1 only.
"""
from __future__ import annotations

import pandas as pd

from refimpl.lab.plan.predict import Layout, predict
from refimpl.lab.predict.hardware import get_hardware
from refimpl.lab.predict.presets import ModelShape

RECOMPUTE = ("none", "selective", "full")
COLUMNS = ["dp", "tp", "pp", "cp", "ep", "zero_stage", "micro_batch_size", "micro_batches", "recompute",
           "sequence_parallel", "memory_bytes", "fits", "step_time_s", "tflops_per_gpu", "mfu",
           "bubble_fraction", "compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_comm_s", "bubble_s",
           "dp_comm_s", "optimizer_s", "params_bytes", "grads_bytes", "optimizer_bytes",
           "activation_bytes"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(shape: ModelShape, global_batch: int, gpus: int, *, tp_sizes=None,
                      pp_sizes=None, cp_sizes=(1, 2, 4, 8), zero_stages=(0, 1, 2, 3),
                      micro_batch_sizes=(1, 2, 4, 8), recompute=RECOMPUTE,
                      sequence_parallel=(False, True), ep_sizes=None):
    """Every valid layout; None for a size list means every divisor that the model allows."""
    for tp in divisors(gpus):
        if shape.n_heads % tp or (tp_sizes is not None and tp not in tp_sizes):
            continue
        for cp in cp_sizes:
            if (gpus // tp) % cp or (gpus % (tp * cp)) or shape.seq_len % (2 * cp if cp > 1 else 1):
                continue
            for pp in divisors(gpus // (tp * cp)):
                if shape.n_layers % pp or (pp_sizes is not None and pp not in pp_sizes):
                    continue
                dp = gpus // (tp * cp * pp)
                for ep in expert_parallel_sizes(shape, dp * cp, ep_sizes):
                    for mbs in micro_batch_sizes:
                        if global_batch % (dp * mbs):
                            continue
                        for zero in zero_stages:
                            if zero and dp * cp == 1:
                                continue   # nothing to shard over
                            for rc in recompute:
                                for sp in sequence_parallel:
                                    if sp and tp == 1:
                                        continue   # sequence parallelism is a tp technique
                                    yield Layout(dp, tp, pp, cp, zero, mbs, rc, sp, ep)


def expert_parallel_sizes(shape: ModelShape, dp_cp: int, ep_sizes=None) -> list[int]:
    """ep sizes for dp x cp = dp_cp ranks: divisors of dp_cp that divide the experts evenly."""
    if not shape.n_experts:
        return [1]
    return [ep for ep in divisors(dp_cp) if shape.n_experts % ep == 0
            and (ep_sizes is None or ep in ep_sizes)]


def rank_layouts(rows: list[dict]) -> pd.DataFrame:
    """Fitting layouts first, fastest first; then the ones that do not fit, smallest first."""
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    df = df.sort_values(["fits", "step_time_s", "memory_bytes"], ascending=[False, True, True],
                        kind="stable")
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]].reset_index(drop=True)


def plan(*, n_layers: int, d_model: int, n_heads: int, vocab_size: int, seq_len: int,
         global_batch: int, gpus: int, gpu="a100-80gb", gpus_per_node: int = 8,
         precision: str = "bf16", tied_embeddings: bool = True, n_experts: int = 0,
         top_k: int = 2, ffn_hidden: int = 0, capacity_factor: float = 1.0, kv_heads: int = 0,
         block: str = "gpt", **space) -> pd.DataFrame:
    """One row per layout, fastest predicted first (DESIGN.md's contract).

    `gpu`: a preset name ("a100-80gb", "h100-sxm", "h200") or a Hardware (e.g. cpu_preset(...)).
    `space`: narrows the search, as enumerate_layouts' keywords (e.g. zero_stages=(0,),
    recompute=("full",) for the techniques of 2021; ep_sizes=(1, 8)). A mixture of experts:
    n_experts > 0 and the fields of refimpl.lab.predict.presets.ModelShape that go with it.
    """
    shape = ModelShape(n_layers, d_model, n_heads, vocab_size, seq_len, tied_embeddings,
                       n_experts, top_k, ffn_hidden, capacity_factor, kv_heads, block)
    hw = get_hardware(gpu)
    rows = [predict(shape, lay, global_batch, hw, gpus_per_node, precision)
            for lay in enumerate_layouts(shape, global_batch, gpus, **space)]
    return rank_layouts(rows)


def best_per_grid(df: pd.DataFrame, axes=("tp", "pp", "cp")) -> pd.DataFrame:
    """The fastest fitting row of each (tp, pp, cp) grid shape, ranked: how a published layout,
    which names only its grid, is compared with the planner's choices."""
    fitting = df[df.fits]
    return fitting.drop_duplicates(list(axes), keep="first").reset_index(drop=True)
