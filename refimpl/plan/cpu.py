"""The planner on this machine: every layout the loop can run on a few CPU ranks, predicted, with
the command that runs it, so predicted and measured step time and memory sit in one table.

    hw = measure_cpu_preset()                         # matmul rate, memcpy, alpha-beta: measured
    table = predict_cpu_runs(hw, world_size=4)        # one row per layout, with its `command`
    # the lead's loop runs each `command` (--json) and adds measured columns; then
    compare_rankings(table, measured_step_time_s)     # Spearman's rho of predicted vs measured

The loop trains in fp32 with AdamW (precision "fp32": 4-byte params and grads, m and v), on one
thread per rank, with the whole world inside one machine (every axis "inside the node").
"""
from __future__ import annotations

import pandas as pd

from refimpl.model import GPTConfig
from refimpl.plan.hardware import Hardware
from refimpl.plan.models import ModelShape
from refimpl.plan.predict import predict
from refimpl.plan.search import enumerate_layouts, rank_layouts

ZERO_STRATEGY = {0: "dp", 1: "zero1", 2: "zero2", 3: "zero3"}


def shape_of(cfg: GPTConfig, seq_len: int) -> ModelShape:
    return ModelShape(cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size, seq_len)


def oversubscribed(hw: Hardware, world_size: int, cores: int | None = None) -> Hardware:
    """One thread per rank, but fewer cores than ranks: each rank computes at cores/ranks of the
    one-thread rate measured alone (the scheduler time-slices them)."""
    import os
    from dataclasses import replace

    share = min(1.0, (cores or os.cpu_count() or 1) / world_size)
    return replace(hw, peak_flops=hw.peak_flops * share, memory_bandwidth=hw.memory_bandwidth * share,
                   block_overhead_s=hw.block_overhead_s / share)


def train_command(row, world_size: int, global_batch: int, seq_len: int, steps: int = 5) -> str:
    """The `python -m refimpl train` line that runs this layout (flags of DESIGN.md's CLI)."""
    strategy = "single" if world_size == 1 else ZERO_STRATEGY[int(row["zero_stage"])]
    parts = [f"python -m refimpl train --strategy {strategy} --nproc {world_size}"]
    parts += [f"--{axis} {row[axis]}" for axis in ("tp", "pp", "cp") if row[axis] > 1]
    parts += [f"--micro-batches {row['micro_batches']}",
              f"--global-batch {global_batch} --seq-len {seq_len} --steps {steps} --json"]
    if row["sequence_parallel"]:
        parts.append("--sequence-parallel")
    if row["recompute"] == "full":
        parts.append("--checkpointing")
    return " ".join(parts)


def predict_cpu_runs(hw: Hardware, world_size: int = 4, cfg: GPTConfig | None = None,
                     global_batch: int = 8, seq_len: int = 32, *, cp_sizes=(1, 2, 4),
                     zero_stages=(0, 1, 2, 3), recompute=("none", "full"),
                     micro_batch_sizes=None, cores: int | None = None) -> pd.DataFrame:
    """Predicted step time and memory of each layout of the tiny GPT on `world_size` CPU ranks,
    fastest first, with the command that runs it. Selective recomputation is left out (the loop's
    checkpointing is per block); micro-batch sizes default to every divisor of the batch.
    `cores` (default: this machine's) shares the measured one-thread rates among the ranks."""
    cfg = cfg or GPTConfig()
    shape = shape_of(cfg, seq_len)
    hw = oversubscribed(hw, world_size, cores)
    sizes = micro_batch_sizes or tuple(d for d in range(1, global_batch + 1) if global_batch % d == 0)
    rows = []
    for lay in enumerate_layouts(shape, global_batch, world_size, cp_sizes=cp_sizes,
                                 zero_stages=zero_stages, micro_batch_sizes=sizes,
                                 recompute=recompute):
        row = predict(shape, lay, global_batch, hw, gpus_per_node=world_size, precision="fp32")
        row["command"] = train_command(row, world_size, global_batch, seq_len)
        rows.append(row)
    return rank_layouts(rows)


def compare_rankings(predicted: pd.Series, measured: pd.Series) -> dict:
    """How well the predicted order matches the measured one: Spearman's rank correlation, whether
    the predicted fastest is the measured fastest, and the median relative error of the times."""
    ranks = pd.DataFrame({"p": predicted.rank(), "m": measured.rank()})
    rel = ((predicted - measured).abs() / measured)
    return {"spearman": float(ranks.p.corr(ranks.m)),
            "same_fastest": bool(predicted.idxmin() == measured.idxmin()),
            "median_rel_error": float(rel.median())}


def measure_cpu_runs(table: pd.DataFrame, timeout: float = 600.0) -> pd.DataFrame:
    """Run each row's `command` (a fresh `python -m refimpl train ... --json`) and add what it
    measured: measured_step_time_s (median step of the slowest rank) and measured_memory_bytes
    (the largest rank's params + grads + optimizer + activation peak)."""
    import json
    import subprocess
    import sys

    times, memory = [], []
    for command in table.command:
        argv = [sys.executable, "-m", "refimpl"] + command.split()[3:]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        times.append(result["step_time_s"])
        memory.append(max(r["total"] for r in result["memory"]))
    return table.assign(measured_step_time_s=times, measured_memory_bytes=memory)
