"""Composing the axes: what notebook 09 computes, here where the tests reach it.

How the axes compose (refimpl.compose.transforms.model_parallel, refimpl.mesh): a rank's model is
the reference with tensor/sequence parallelism, context parallelism and activation checkpointing
applied, then cut into its pipeline stage; the data-parallel strategy (dp-naive, zero1/2/3, fsdp)
then shards or replicates that share over the dp x cp ranks that hold the same share. Each
collective runs on one axis's group: tp's inside every block, pp's sends between stages, dp's
once per step (or per unit, for ZeRO-3/FSDP).

Which pairs compose here (tests/test_composition.py) and which fail before launch, in one line:
  dp x tp, dp x pp, tp x pp, pp x cp, dp x tp x pp, any of them with zero1/2/3 or fsdp on dp,
  with --sequence-parallel and --checkpointing                                  -> equal to single
  tp x cp                      ring attention over tensor-parallel heads is not built
  `dp` (bucketed) with --pp    its bucket hooks are gated by micro_step, which a schedule skips
  zero3 / fsdp with zb-h1      the deferred weight gradients bypass the per-unit reduce-scatter

The placement rule of MT-NLG and Megatron-LM ("model parallel inside a node, data parallel across
nodes"; seed 003) as arithmetic: `placement_rule` compares each axis's traffic with the compute it
must hide behind, on NVLink and on InfiniBand (refimpl.cost.hardware's presets, α-β ring model).
"""
from __future__ import annotations

import pandas as pd

from refimpl.cost.alpha_beta import ring_seconds
from refimpl.cost.hardware import Hardware
from refimpl.plan.models import ModelShape


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
        2 in backward (Shoeybi et al. 2019, §3), against that layer's share of the dense GEMMs:
        72·b·s·d² FLOPs (forward + backward, 4h MLP; Narayanan et al. 2021, §5.1) / tp.
    dp: one all-reduce of this rank's bf16 gradients, 2·Ψ/(tp·pp) bytes, per step, against the
        step's GEMMs on this rank: 72·B·s·d²·L / (dp·tp·pp).
    """
    b, s, d, layers = micro_batch_size, shape.seq_len, shape.d_model, shape.n_layers
    rate = hw.matmul_rate
    layer_compute = 72 * b * s * d * d / tp / rate
    step_compute = 72 * global_batch * s * d * d * layers / (dp * tp * pp) / rate
    psi = 12 * layers * d * d + shape.vocab_size * d           # parameters (Narayanan et al. eq. 2)
    rows = []
    for within, link in ((True, "NVLink (inside a node)"), (False, "InfiniBand (across nodes)")):
        alpha, beta = hw.link(within)
        tp_comm = 4 * ring_seconds("all_reduce", b * s * d * bytes_per_value, tp, alpha, beta)
        dp_comm = ring_seconds("all_reduce", bytes_per_value * psi / (tp * pp), dp, alpha, beta)
        rows.append({"axis": "tp", "link": link, "per": "layer x micro-batch",
                     "comm_s": tp_comm, "compute_s": layer_compute})
        rows.append({"axis": "dp", "link": link, "per": "step",
                     "comm_s": dp_comm, "compute_s": step_compute})
    df = pd.DataFrame(rows)
    df["comm_over_compute"] = df.comm_s / df.compute_s
    return df
