"""The planner checked on this machine: every layout the loop runs on a few CPU ranks, predicted,
then run, so predicted and measured step time and memory sit in one table.

    hw = calibrated_cpu_preset(world_size=4)          # alpha-beta, memcpy, compute: measured here
    table = cpu_layouts(hw, world_size=4)             # one row per layout, predicted, runnable
    table = measure_cpu_layouts(table, steps=3)       # + measured_step_time_s, measured_memory_bytes
    ranking_agreement(table.memory_bytes, table.measured_memory_bytes)

The loop trains in fp32 with AdamW (precision "fp32": 4-byte params and grads, m and v), on one
thread per rank, with the whole world inside one machine (every axis "inside the node").

Memory is deterministic (refimpl.train counts the tensors a rank holds and the activations saved
for backward), so tests assert it. Step time is wall time: scripts/bench_plan_cpu.py measures it in
interleaved rounds and prints how well the predicted order matches; tests never assert it.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from refimpl.config import TrainConfig
from refimpl.cost.alpha_beta import ring_seconds
from refimpl.lab.env import cpu_cores
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.plan.cpu_calibration import (  # noqa: F401  (re-exported: the notebook, the bench)
    calibrate_compute,
    calibrated_cpu_preset,
    shape_of,
)
from refimpl.lab.plan.predict import PRECISIONS, Layout, micro_batch_work, predict
from refimpl.lab.plan.search import enumerate_layouts, rank_layouts
from refimpl.lab.predict.hardware import Hardware
from refimpl.lab.predict.presets import ModelShape
from refimpl.lab.verify.step_time import step_times_in_rounds
from refimpl.model import GPT, GPTConfig

ZERO_STRATEGY = {0: "dp", 1: "zero1", 2: "zero2", 3: "zero3"}
LAYOUT_COLUMNS = ["dp", "tp", "pp", "cp", "zero_stage", "micro_batch_size", "recompute",
                  "sequence_parallel"]


def cpu_strategy(zero_stage: int, pp: int) -> str:
    """The loop's strategy for a ZeRO stage. Stage 0 under a pipeline stays dp-naive here (one
    all-reduce per parameter tensor: what `grad_messages` counts), though the bucketed `dp` runs
    under pp too (refimpl.parallel.dp.bucketed)."""
    return "dp-naive" if zero_stage == 0 and pp > 1 else ZERO_STRATEGY[zero_stage]


def runs_here(lay: Layout) -> bool:
    """Is this layout in the CPU table? The loop runs every layout `validate` accepts, tp x cp too
    (tests/test_tp_cp.py); the table leaves tp x cp out only to bound the measured launches of
    tests/test_plan_cpu.py and notebook 09."""
    return not (lay.tp > 1 and lay.cp > 1)


def stage_tensors(cfg: GPTConfig, pp: int) -> int:
    """Parameter tensors of the busiest (last) stage: what dp-naive all-reduces one by one."""
    model = GPT(cfg)
    last = (_tensors(model.blocks[0]) * (cfg.n_layers // pp) + _tensors(model.final_norm)
            + _tensors(model.lm_head))
    return last + (_tensors(model.embed) if pp == 1 else 0)


def _tensors(module) -> int:
    return len(list(module.parameters()))


def grad_messages(cfg: GPTConfig, lay: Layout) -> int:
    """How many collectives the loop's gradient sync sends per step (the planner's default, 1, is
    a bucketed sync): dp-naive all-reduces each tensor; zero1/zero2 reduce each owner's shard to
    it, one reduce per rank of dp x cp (refimpl/parallel/zero/shards.py); `dp`'s one bucket holds the
    tiny model's gradients whole."""
    if cpu_strategy(lay.zero_stage, lay.pp) == "dp-naive":
        return stage_tensors(cfg, lay.pp)
    if lay.zero_stage in (1, 2):
        return lay.dp * lay.cp
    return 1


def sp_grad_sync_s(cfg: GPTConfig, lay: Layout, hw: Hardware, micro_batches: int) -> float:
    """What the planner leaves out and refimpl's sequence parallelism pays: every parameter that
    sees only this rank's tokens (the LayerNorms' weights and biases, the row-parallel layers'
    biases: 6 per block; the final norm's 2 on the last stage) has a partial gradient, all-reduced
    over tp by a hook in every backward (refimpl/parallel/tp/parallelize.py). Megatron-LM sums them once
    per step instead. Small messages: on CPU ranks each costs about alpha per ring step."""
    if not lay.sequence_parallel or lay.tp == 1:
        return 0.0
    alpha, beta = hw.link(True)
    block = GPT(replace(cfg, n_layers=1)).blocks[0]
    per_block = (_tensors(block.ln1) + _tensors(block.ln2)
                 + sum(linear.bias is not None for linear in (block.attn.o, block.mlp.down)))
    tensors = per_block * (cfg.n_layers // lay.pp) + 2   # + the final norm's weight and bias
    return micro_batches * tensors * ring_seconds("all_reduce", 4 * cfg.d_model, lay.tp, alpha, beta)


def exposed_comm_s(row) -> float:
    """The communication of a step that nothing hides: each micro-batch's tp, cp and pp messages
    on the busiest stage (a MoE's all-to-alls too), (m + p - 1) times (its own and its share of the bubble), plus the dp sync."""
    m, p = row["micro_batches"], row["pp"]
    per_micro_batch = row["tp_comm_s"] + row["cp_comm_s"] + row["pp_comm_s"] + row.get("ep_comm_s", 0.0)
    return per_micro_batch / m * (m + p - 1) + row["dp_comm_s"]


def time_sliced_step(row, world_size: int, cores: int, waiting_s: float | None = None) -> dict:
    """A step of ranks that share `cores` cores (one thread each), from the planner's terms at
    one-core speed. A rank's CPU work is its compute, its optimizer and the byte-moving part of its
    communication (gloo copies and sums on the rank's own core); the latency part (`waiting_s`,
    the alpha terms; default: all of the communication) is waiting, which uses no core. The work
    is bounded below by the pipeline's critical path (every rank with a core to itself: m + p - 1
    micro-batches) and by all ranks' work spread over the cores; the waiting is added, as a CPU
    rank hides no blocking collective. With a core per rank this is the planner's own step; with
    fewer, a pipeline bubble costs less than the planner's formula says (an idle stage frees its
    core for another) and everything else more."""
    m, p = row["micro_batches"], row["pp"]
    per_micro_batch = row["compute_s"] / m
    # the stages' mean work: the busiest (the planner's row) holds the embedding or the head too
    mean_compute = row.get("mean_compute_s", row["compute_s"])
    fixed = row["optimizer_s"] + row.get("step_overhead_s", 0.0)
    comm = exposed_comm_s(row)
    waiting = comm if waiting_s is None else waiting_s
    moving = comm - waiting
    critical = (m + p - 1) * per_micro_batch + fixed + moving
    busy = world_size * (mean_compute + fixed + moving) / min(cores, world_size)
    return {"critical_path_s": critical, "core_bound_s": busy, "exposed_comm_s": comm,
            "waiting_s": waiting, "step_time_s": max(critical, busy) + waiting}


def mean_stage_compute_s(shape: ModelShape, lay: Layout, hw: Hardware, micro_batches: int) -> float:
    """A stage's compute averaged over the pipeline: the whole model's (pp = 1) over p. The
    planner's row is the busiest stage's, which holds the embedding or the head besides its
    blocks; p ranks sharing the cores do the whole model's work once, not p busiest stages'."""
    work = micro_batch_work(shape, replace(lay, pp=1), PRECISIONS["fp32"]["activation"])
    per_micro_batch = (work["flops"] / hw.matmul_rate + work["hbm_bytes"] / hw.memory_bandwidth
                       + work["block_passes"] * hw.block_overhead_s)
    return micro_batches * per_micro_batch / lay.pp


def train_config(row, world_size: int, cfg: GPTConfig, global_batch: int, seq_len: int,
                 steps: int) -> TrainConfig:
    """The loop's configuration for one row of the planner's table."""
    return TrainConfig(strategy=cpu_strategy(int(row["zero_stage"]), int(row["pp"])),
                       nproc=world_size, tp=int(row["tp"]), pp=int(row["pp"]), cp=int(row["cp"]),
                       micro_batches=int(row["micro_batches"]), global_batch=global_batch,
                       seq_len=seq_len, steps=steps, model=cfg,
                       activation_checkpointing=row["recompute"] == "full",
                       sequence_parallel=bool(row["sequence_parallel"]),
                       device="cpu")   # gloo ranks on CPU cores, even on a GPU machine


def train_command(row, world_size: int, global_batch: int, seq_len: int, steps: int = 5) -> str:
    """The `python -m refimpl train` line that runs this layout (flags of DESIGN.md's CLI)."""
    strategy = cpu_strategy(int(row["zero_stage"]), int(row["pp"]))
    parts = [f"python -m refimpl train --strategy {strategy} --nproc {world_size}"]
    parts += [f"--{axis} {row[axis]}" for axis in ("tp", "pp", "cp") if row[axis] > 1]
    parts += [f"--micro-batches {row['micro_batches']}",
              f"--global-batch {global_batch} --seq-len {seq_len} --steps {steps} --json"]
    if row["sequence_parallel"]:
        parts.append("--sequence-parallel")
    if row["recompute"] == "full":
        parts.append("--checkpointing")
    return " ".join(parts)


def cpu_layouts(hw: Hardware, world_size: int = 4, cfg: GPTConfig | None = None,
                global_batch: int = 8, seq_len: int = 32, *, micro_batch_sizes=(2,),
                recompute=("none", "full"), cp_sizes=(1, 2, 4), zero_stages=(0, 1, 2, 3),
                cores: int | None = None) -> pd.DataFrame:
    """Every layout of the tiny GPT that the loop runs on `world_size` CPU ranks, predicted, fastest
    first, with the command that runs it. Selective recomputation is left out (the loop's
    checkpointing is per block). Step times are time_sliced_step's, for `cores` (default: the
    cores this process may use) shared by the ranks."""
    cfg = cfg or GPTConfig()
    shape = shape_of(cfg, seq_len)
    cores = cores or cpu_cores()
    # the same links with infinite bandwidth: what is left of each message is its latency
    latency_only = replace(hw, intra_bandwidth=float("inf"), inter_bandwidth=float("inf"))
    rows = []
    for lay in enumerate_layouts(shape, global_batch, world_size, cp_sizes=cp_sizes,
                                 zero_stages=zero_stages, micro_batch_sizes=micro_batch_sizes,
                                 recompute=recompute):
        if not runs_here(lay):
            continue
        row, waits = (predict(shape, lay, global_batch, links, gpus_per_node=world_size,
                              precision="fp32", grad_messages=grad_messages(cfg, lay),
                              zero2_per_micro_batch=lay.pp == 1)   # refimpl's zero2 (dp_sync)
                      for links in (hw, latency_only))
        row["planner_step_time_s"] = row["step_time_s"]   # every rank with a core to itself
        row["mean_compute_s"] = mean_stage_compute_s(shape, lay, hw, row["micro_batches"])
        for r, links in ((row, hw), (waits, latency_only)):
            r["tp_comm_s"] += sp_grad_sync_s(cfg, lay, links, r["micro_batches"])
        row.update(time_sliced_step(row, world_size, cores, waiting_s=exposed_comm_s(waits)))
        row["strategy"] = cpu_strategy(lay.zero_stage, lay.pp)
        row["command"] = train_command(row, world_size, global_batch, seq_len)
        rows.append(row)
    return rank_layouts(rows)


def measure_cpu_layouts(table: pd.DataFrame, world_size: int = 4, cfg: GPTConfig | None = None,
                        global_batch: int = 8, seq_len: int = 32, steps: int = 3,
                        rounds: int = 1) -> pd.DataFrame:
    """Run every row on `world_size` ranks, in one launch, `rounds` times interleaved, and add
    what was measured: measured_step_time_s (median over rounds of the slowest rank's steps after
    the first; refimpl.lab.verify.step_time; NaN with steps=1), measured_memory_bytes (the largest
    rank's params + grads + optimizer + activation peak, the same in every round), and its parts:
    measured_state_bytes (each rank's params + grads + optimizer, rank order) and
    measured_activation_bytes (the largest rank's activation peak)."""

    cfg = cfg or GPTConfig()
    variants = {i: train_config(row, world_size, cfg, global_batch, seq_len, steps)
                for i, row in table.iterrows()}
    if steps >= 2:
        times, last = step_times_in_rounds(variants, rounds)
    else:   # memory only: a single step has no step after the warm-up to time
        last = dict(zip(variants, train_several_on_ranks(list(variants.values()))))
        times = {i: float("nan") for i in variants}
    memory = {i: max(r["total"] for r in result["memory"]) for i, result in last.items()}
    states = {i: tuple(r["params"] + r["grads"] + r["optimizer"] for r in result["memory"])
              for i, result in last.items()}
    activations = {i: max(r["activations_peak"] for r in result["memory"]) for i, result in last.items()}
    return table.assign(measured_step_time_s=pd.Series(times),
                        measured_memory_bytes=pd.Series(memory),
                        measured_state_bytes=pd.Series(states),
                        measured_activation_bytes=pd.Series(activations))


def one_layout_per_grid(table: pd.DataFrame) -> pd.DataFrame:
    """A layout per grid of dp x tp x pp x cp, the ZeRO stages taken in turn, and one with
    sequence parallelism: every axis, stage and SP once, for a launch a third as long as the
    whole table's (notebook 09 and tests/test_plan_cpu.py; make test-full measures them all)."""
    rows = []
    for i, (_, g) in enumerate(table.groupby(["dp", "tp", "pp", "cp"], sort=True)):
        plain = g[~g.sequence_parallel]
        stage = plain[plain.zero_stage == i % 4]
        rows.append((stage if len(stage) else plain).index[0])
    rows.append(table[table.sequence_parallel].index[0])
    return table.loc[rows]


def ranking_agreement(predicted: pd.Series, measured: pd.Series, margin: float = 0.0) -> dict:
    """How well the predicted order matches the measured one.

    spearman: rank correlation; same_fastest: the predicted best is the measured best;
    median/max_rel_error: |predicted - measured| / measured; misordered: the pairs whose measured
    values differ by more than `margin` (relative to the smaller) that the prediction orders the
    other way -- a pair closer than the measurement's own spread has no order to match.
    """
    ranks = pd.DataFrame({"p": predicted.rank(), "m": measured.rank()})
    rel = (predicted - measured).abs() / measured
    keys = list(measured.index)
    misordered = []
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            lo, hi = sorted((measured[a], measured[b]))
            if hi > lo * (1 + margin) and (predicted[a] - predicted[b]) * (measured[a] - measured[b]) < 0:
                misordered.append((a, b))
    return {"spearman": float(ranks.p.corr(ranks.m)),
            "same_fastest": bool(predicted.idxmin() == measured.idxmin()),
            "median_rel_error": float(rel.median()), "max_rel_error": float(rel.max()),
            "misordered": misordered}


def layout_name(row) -> str:
    """dp2 tp2 zero1 ckpt sp: the axes above 1, the ZeRO stage, and the techniques switched on."""
    parts = [f"{axis}{int(row[axis])}" for axis in ("dp", "tp", "pp", "cp") if row[axis] > 1]
    parts.append(row["strategy"] if row["zero_stage"] == 0 else f"zero{int(row['zero_stage'])}")
    if row["recompute"] == "full":
        parts.append("ckpt")
    if row["sequence_parallel"]:
        parts.append("sp")
    return " ".join(parts)


def comparison_view(table: pd.DataFrame) -> pd.DataFrame:
    """measure_cpu_layouts' table for reading: one row per layout, fastest measured first, memory
    in MiB and times in ms, measured beside predicted, and the parts of the predicted step."""
    columns = {"measured_step_time_s": "measured ms", "step_time_s": "predicted ms",
               "critical_path_s": "critical path ms", "core_bound_s": "cores bound ms",
               "waiting_s": "waiting ms", "measured_memory_bytes": "measured MiB",
               "memory_bytes": "predicted MiB"}
    view = table.sort_values("measured_step_time_s", kind="stable")
    out = pd.DataFrame({"layout": [layout_name(row) for _, row in view.iterrows()]}, index=view.index)
    for column, name in columns.items():
        out[name] = view[column] * (1e3 if name.endswith(" ms") else 2 ** -20)
    return out.round(2).reset_index(drop=True)

