"""The planner's memory beside the dry run's, layout by layout, category by category.

    row = compare("70b", TrainConfig(strategy="zero1", nproc=64, tp=8, pp=4))
    table = compare_grid(GRID)         # one row per layout: predicted, ran, relative error

The dry run (refimpl.lab.verify.dryrun) runs refimpl's own code for rank 0 (the first pipeline stage:
the rank the planner's `stage_params` describes) of the full-size layout; the planner
(refimpl.lab.plan.predict.predict_memory) predicts the same rank from its formulas, at refimpl's
precision ("fp32": 4-byte params and grads, AdamW's m and v) and with refimpl's own block
(activations="refimpl": refimpl.memory.tp_block_activation_bytes, not Korthikanti's Megatron
block with dropout). Model states should agree to within 1 % and the peak to within 10 %.
"""
from __future__ import annotations

import pandas as pd

from refimpl.config import TrainConfig
from refimpl.lab.plan.predict import Layout, predict_memory
from refimpl.lab.predict.hardware import MEMORY_HEADROOM, get_hardware
from refimpl.lab.predict.presets import get_model
from refimpl.lab.verify.dryrun import default_batch, dry_run, preset_config

ZERO_STAGE = {"dp": 0, "dp-naive": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
CATEGORIES = {"params": "params_bytes", "grads": "grads_bytes", "optimizer": "optimizer_bytes",
              "activations_peak": "activation_bytes", "peak": "memory_bytes"}

# Layouts of the 7B and 70B presets: every dp flavour, tp, pp, cp, recomputation, SP.
GRID = [
    ("7b", dict(strategy="dp", nproc=8)),
    ("7b", dict(strategy="zero1", nproc=8)),
    ("7b", dict(strategy="zero2", nproc=8)),
    ("7b", dict(strategy="zero3", nproc=8)),
    ("7b", dict(strategy="fsdp", nproc=16, activation_checkpointing=True)),
    ("7b", dict(strategy="zero1", nproc=16, tp=4)),
    ("7b", dict(strategy="zero1", nproc=16, tp=4, sequence_parallel=True)),
    ("7b", dict(strategy="zero2", nproc=16, pp=4)),
    ("7b", dict(strategy="fsdp", nproc=16, cp=4)),
    ("70b", dict(strategy="zero1", nproc=64, tp=8, pp=4)),
    ("70b", dict(strategy="dp-naive", nproc=64, tp=8, pp=8)),
    ("70b", dict(strategy="zero2", nproc=128, tp=8, pp=4, sequence_parallel=True)),
    ("70b", dict(strategy="zero3", nproc=256, tp=8, activation_checkpointing=True)),
    ("70b", dict(strategy="fsdp", nproc=1024, cp=8, activation_checkpointing=True)),
]


# The seed's 70B example on 64 GPUs (notebook 09 §4 searches it; notebook 11 runs these): tp 8
# inside a node in both, ZeRO-1 over a 4-stage pipeline (notebook 11's dry-run command), ZeRO-3 over half
# as many stages with twice the data parallelism.
SEED_70B_64 = [
    dict(strategy="zero1", nproc=64, tp=8, pp=4),
    dict(strategy="zero3", nproc=64, tp=8, pp=2),
]


def layout_of(cfg: TrainConfig) -> Layout:
    dp = cfg.dims.dp
    return Layout(dp=dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, zero_stage=ZERO_STAGE[cfg.strategy],
                  micro_batch_size=cfg.global_batch // (dp * cfg.micro_batches),
                  recompute="full" if cfg.activation_checkpointing else "none",
                  sequence_parallel=cfg.sequence_parallel, ep=cfg.dims.ep)


def compare(preset: str, cfg: TrainConfig, rank: int = 0) -> dict:
    """One layout: the dry run's memory and the planner's, and their relative error per category."""
    cfg = default_batch(preset_config(preset, cfg.with_(device="cpu")))
    shape, _ = get_model(preset)
    ran = dry_run(cfg, rank=rank)
    predicted = predict_memory(shape, layout_of(cfg), cfg.global_batch, precision="fp32",
                               activations="refimpl")
    row = {"model": preset, "strategy": cfg.strategy, "nproc": cfg.nproc, "dp": cfg.dims.dp,
           "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp, "sp": cfg.sequence_parallel,
           "recompute": "full" if cfg.activation_checkpointing else "none", "rank": rank}
    for category, key in CATEGORIES.items():
        row[f"{category}_ran"] = ran["memory"][category]
        row[f"{category}_plan"] = predicted[key]
        row[f"{category}_err"] = predicted[key] / ran["memory"][category] - 1
    # what the same layout would need in bf16 mixed precision (refimpl.lab.plan.memory.PRECISIONS:
    # bf16 weights and activations, fp32 gradients, fp32 master weights and moments): the
    # planner's figure only, since refimpl's loop trains in fp32 or fp64 and has no bf16 run to check
    row["peak_plan_bf16"] = predict_memory(shape, layout_of(cfg), cfg.global_batch, precision="bf16",
                                           activations="refimpl")["memory_bytes"]
    row["comm"] = ran["comm"]
    return row


def compare_grid(grid=GRID) -> pd.DataFrame:
    return pd.DataFrame([compare(preset, TrainConfig(**kw)) for preset, kw in grid])


def compare_again(preset: str, layout: dict, table: pd.DataFrame) -> dict:
    """`compare(preset, TrainConfig(**layout))`, or the row of `table` (a compare_grid) that
    already ran that layout: a dry run of a 70B layout costs seconds, a lookup nothing."""
    cfg = TrainConfig(**layout)
    key = {"model": preset, "strategy": cfg.strategy, "nproc": cfg.nproc, "tp": cfg.tp,
           "pp": cfg.pp, "cp": cfg.cp, "sp": cfg.sequence_parallel,
           "recompute": "full" if cfg.activation_checkpointing else "none", "rank": 0}
    same = table[(table[list(key)] == pd.Series(key)).all(axis=1)]
    return same.iloc[0].to_dict() if len(same) else compare(preset, cfg)


def will_it_fit(row: dict, gpu: str) -> dict:
    """Does the layout of a `compare` row fit on `gpu` (refimpl.lab.predict.hardware)? Its usable memory
    is the planner's own rule, MEMORY_HEADROOM of the capacity (the CUDA context, NCCL's buffers
    and the allocator's slack take the rest); the dry run's peak and the planner's each answer,
    and the planner alone for bf16 mixed precision (no run of it to compare)."""
    hw = get_hardware(gpu)
    usable = MEMORY_HEADROOM * hw.memory_bytes
    return {"gpu": hw.name, "capacity_bytes": hw.memory_bytes, "usable_bytes": usable,
            "dry_run_bytes": row["peak_ran"], "planner_bytes": row["peak_plan"],
            "planner_error": row["peak_err"],
            "fits_by_dry_run": bool(row["peak_ran"] <= usable),
            "fits_by_planner": bool(row["peak_plan"] <= usable),
            "planner_bf16_bytes": row["peak_plan_bf16"],
            "fits_in_bf16_by_planner": bool(row["peak_plan_bf16"] <= usable)}
