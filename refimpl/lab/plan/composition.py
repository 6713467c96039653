"""Composing the axes: what notebook 09 computes, here where the tests reach it.

How the axes compose (refimpl.compose.transforms.model_parallel, refimpl.mesh): a rank's model is
the reference with tensor/sequence parallelism, context parallelism and activation checkpointing
applied, then cut into its pipeline stage; the data-parallel strategy (dp-naive, dp, zero1/2/3, fsdp)
then shards or replicates that share over the dp x cp ranks that hold the same share. Each
collective runs on one axis's group: tp's inside every block, pp's sends between stages, dp's
once per step (or per unit, for ZeRO-3/FSDP).

Which pairs compose here (tests/test_composition.py) and which fail before launch, in one line:
  dp x tp, dp x pp, tp x pp, pp x cp, dp x tp x pp, tp x cp (ring attention over each tp rank's
  heads, refimpl.compose.tp_cp), dp x tp x cp, cp x tp x pp, any of them with dp, zero1/2/3 or
  fsdp on dp (under every schedule, the split ones included, tp's too: tests/test_dp_under_pp.py,
  tests/test_composition.py), with
  --sequence-parallel and --checkpointing                                       -> equal to single
  experts x tp (each expert split over tp; +sp), x ep over dp, and a MoE model under dp-naive,
  dp, zero1/2/3 or fsdp with --ep (experts synced or sharded over edp) (tests/test_moe_tp_dp.py)
                                                                                -> equal to single
  --experts (ep, or replicated) with pp (any schedule) and cp (lab.moe_scope) -> equal to single
  --ep with PyTorch's twins    they sum every gradient over dp x cp, different experts' included

The placement rule of MT-NLG and Megatron-LM ("model parallel inside a node, data parallel across
nodes"; seed 003) as arithmetic: `placement_rule` compares each axis's traffic with the compute it
must hide behind, on NVLink and on InfiniBand (refimpl.lab.predict.hardware's presets, α-β ring model).
"""
from __future__ import annotations

import math

import pandas as pd
import torch

from refimpl.cost.alpha_beta import ring_seconds
from refimpl.lab.predict.hardware import Hardware
from refimpl.lab.predict.presets import ModelShape
from refimpl.lab.predict.tp_comm import (
    LayerShape,
    bytes_per_layer,
    comm_and_compute_seconds,
    flops_per_layer,
    pp_boundary_bytes,
)


def collectives_per_step(trace: pd.DataFrame, rank: int = 0) -> pd.DataFrame:
    """Our labelled collectives (comm:<op> <bytes>B) of one rank, counted per step: one row per
    (op, bytes) with the number of calls in each step (equal in every step of a steady run)."""
    comm = trace[(trace["rank"] == rank) & trace.step.notna() & trace.name.str.startswith("comm:")
                 & trace.bytes.notna()]
    counts = comm.groupby(["op", "bytes", "step"]).size().unstack("step", fill_value=0)
    counts.columns = [f"step {int(s)}" for s in counts.columns]
    return counts.reset_index().astype({"bytes": int})


def tp_activation_bytes(global_batch: int, dp: int, seq_len: int, d_model: int,
                        bytes_per_value: int = 4) -> int:
    """One tensor-parallel all-reduce of the residual stream: this dp rank's rows x s x d."""
    return global_batch // dp * seq_len * d_model * bytes_per_value


def placement_rule(shape: ModelShape, hw: Hardware, *, tp: int, pp: int, dp: int,
                   micro_batch_size: int = 1, global_batch: int = 1024,
                   bytes_per_value: int = 2) -> pd.DataFrame:
    """Each axis's communication against the compute it overlaps with, on either link.

    tp: 4 all-reduces of the activations (b·s·d values) per layer per micro-batch, 2 in forward and
        2 in backward (Shoeybi et al. 2019, §3), against that layer's share of the compute:
        refimpl.lab.predict.tp_comm.comm_and_compute_seconds, the one ratio notebook 06 prints too.
    dp: one all-reduce of this rank's bf16 gradients, 2·Ψ/(tp·pp) bytes, per step, against the
        step's compute on this rank: L layers of tp_comm.flops_per_layer for B sequences / (dp·tp·pp).
    """
    b, s, d, layers = micro_batch_size, shape.seq_len, shape.d_model, shape.n_layers
    step_compute = flops_per_layer(LayerShape(global_batch, s, d)) * layers / (dp * tp * pp) / hw.matmul_rate
    psi = 12 * layers * d * d + shape.vocab_size * d           # parameters (Narayanan et al. eq. 2)
    rows = []
    for within, link in ((True, "NVLink (inside a node)"), (False, "InfiniBand (across nodes)")):
        alpha, beta = hw.link(within)
        tp_comm, layer_compute = comm_and_compute_seconds(LayerShape(b, s, d, bytes_per_value), tp, hw, within)
        dp_comm = ring_seconds("all_reduce", bytes_per_value * psi / (tp * pp), dp, alpha, beta)
        rows.append({"axis": "tp", "link": link, "per": "layer x micro-batch",
                     "comm_s": tp_comm, "compute_s": layer_compute})
        rows.append({"axis": "dp", "link": link, "per": "step",
                     "comm_s": dp_comm, "compute_s": step_compute})
    df = pd.DataFrame(rows)
    df["comm_over_compute"] = df.comm_s / df.compute_s
    return df


# --- the order of the axes in the rank grid -----------------------------------------------------------

# Outermost first. Megatron-LM's default order string is "tp-cp-ep-dp-pp", innermost first
# (megatron/core/parallel_state.py, `order`), ep folded here into dp; DeepSpeed's
# PipeModelDataParallelTopology is axes=["pipe", "data", "model"], outermost first (no cp axis).
ORDERS = {"refimpl (dp, pp, cp, tp)": ("dp", "pp", "cp", "tp"),
          "Megatron-LM (pp, dp, cp, tp)": ("pp", "dp", "cp", "tp"),
          "DeepSpeed (pipe, data, model)": ("pp", "dp", "tp")}


def groups_in_order(sizes: dict[str, int], order: tuple[str, ...]) -> dict[str, list[list[int]]]:
    """Every axis's groups when the ranks are laid out as arange(world).view(sizes in `order`)."""
    grid = torch.arange(math.prod(sizes[a] for a in order)).view(*(sizes[a] for a in order))
    return {a: grid.movedim(i, -1).reshape(-1, sizes[a]).tolist() for i, a in enumerate(order)}


def order_costs(sizes: dict[str, int], shape: ModelShape, gpus_per_node: int = 8, *,
                micro_batch_size: int = 1, global_batch: int = 1024, bytes_per_value: int = 2) -> pd.DataFrame:
    """For each layout order of ORDERS: which axes' groups leave a node (ranks r and r' share a node
    when r // gpus_per_node == r' // gpus_per_node) and the bytes each axis sends per GPU per step,
    so what crosses InfiniBand under each order can be read off.

    tp: 8·b·s·h·(t-1)/t per layer per micro-batch (tp_comm.bytes_per_layer), L/pp layers, m micro-batches;
    pp: a middle stage sends one activation forward and one gradient back per micro-batch, b·s·h
        values each, /tp (each tp rank sends its slice: Narayanan et al. 2021 §4.1's scatter/gather);
        with pp = 2 each stage sends only one of the two;
    dp: the ring all-reduce of this rank's gradients, 2(d-1)/d · 2Ψ/(tp·pp) bytes, once a step."""
    tp, pp, dp, cp = (sizes.get(a, 1) for a in ("tp", "pp", "dp", "cp"))
    m = global_batch // (dp * micro_batch_size)
    b, s, h = micro_batch_size, shape.seq_len // cp, shape.d_model
    sent = {"tp": shape.n_layers / pp * m * bytes_per_layer(b, s, h, tp, bytes_per_value),
            "pp": m * pp_boundary_bytes(b, s, h, bytes_per_value) / tp * (1.0 if pp > 2 else 0.5 * (pp > 1)),
            "dp": 2 * (dp - 1) / dp * bytes_per_value * shape.n_params / (tp * pp),
            "cp": 0.0}
    rows = []
    for name, order in ORDERS.items():
        present = {a: sizes.get(a, 1) for a in order}
        if math.prod(present.values()) != math.prod(sizes.values()):
            continue                                      # the order has no axis for one of ours
        for axis, groups in groups_in_order(present, order).items():
            if present[axis] == 1:
                continue
            crosses = any(len({r // gpus_per_node for r in g}) > 1 for g in groups)
            rows.append({"order": name, "axis": axis, "size": present[axis], "stride": groups[0][1] - groups[0][0],
                         "leaves the node": crosses, "GB sent per GPU per step": sent[axis] / 1e9})
    return pd.DataFrame(rows)
