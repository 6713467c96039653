"""The planner against published trainings: Narayanan et al. 2021, Table 1 (refimpl.lab.predict.presets).

`compare_with_megatron()` searches, for each of the ten runs, the layouts their techniques allowed
(TECHNIQUES_2021: tensor + pipeline + data parallelism, full recomputation, no ZeRO, no sequence
or context parallelism) on the same model, GPU count and batch, and reports where their (t, p)
grid ranks among the planner's grids, how much slower the planner predicts it to be than its own
best, and the predicted vs the measured teraFLOP/s per GPU. With every technique allowed, it also
reports the planner's best layout and its predicted speed-up over theirs.

`published_grid_ranks()` asks today's question of thirteen runs (Table 1, GPT-3 175B on 1024
GPUs, Narayanan et al. §5.1, BLOOM 176B and Llama 3 405B): with every technique allowed (ZeRO,
sequence and context parallelism, selective recomputation, bf16), where does their (t, p) rank
among the planner's best layout of each (t, p), on the GPUs and network they trained on?
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from refimpl.lab.plan.search import best_per_grid, plan
from refimpl.lab.predict.hardware import GPUS
from refimpl.lab.predict.links import gbit
from refimpl.lab.predict.presets import GPT3_ON_1024, MODELS, megatron_runs

TECHNIQUES_2021 = dict(zero_stages=(0,), recompute=("full",), sequence_parallel=(False,),
                       cp_sizes=(1,), precision="fp16")   # fp16 with loss scaling, 16-bit grads


def compare_with_megatron(runs=None, with_all_techniques: bool = True) -> pd.DataFrame:
    rows = []
    for run in runs or megatron_runs():
        common = dict(**run["shape"].to_dict(), global_batch=run["global_batch"], gpus=run["gpus"])
        grids = best_per_grid(plan(**common, **TECHNIQUES_2021))
        match = grids[(grids.tp == run["tp"]) & (grids.pp == run["pp"])]
        if match.empty:
            raise AssertionError(f"{run['params_b']}B: their layout t={run['tp']} p={run['pp']} "
                                 "is not predicted to fit")
        theirs, best = match.iloc[0], grids.iloc[0]
        row = {"params_b": run["params_b"], "gpus": run["gpus"],
               "their_grid": f"t{run['tp']} p{run['pp']}", "grid_rank": int(match.index[0]),
               "planner_grid": f"t{best.tp} p{best.pp}",
               "slower_than_best": float(theirs.step_time_s / best.step_time_s - 1),
               "predicted_tflops": float(theirs.tflops_per_gpu),
               "achieved_tflops": run["achieved_tflops"]}
        row["ratio"] = row["predicted_tflops"] / row["achieved_tflops"]
        if with_all_techniques:
            top = plan(**common).iloc[0]
            row["best_with_all_techniques"] = (
                f"dp{top.dp} t{top.tp} p{top.pp} cp{top.cp} zero{top.zero_stage} "
                f"b{top.micro_batch_size} {top.recompute}{' sp' if top.sequence_parallel else ''}")
            row["predicted_speedup"] = float(theirs.step_time_s / top.step_time_s)
        rows.append(row)
    return pd.DataFrame(rows)


# Jean Zay's A100 partition, where BLOOM trained (Le Scao et al. 2022, §3.4.1): 8 A100 80GB a
# node joined by NVLink, and 4 Omni-Path 100 Gb/s links a node between nodes: 50 Gb/s per GPU, a
# quarter of a DGX A100's one 200 Gb/s HDR NIC per GPU (the a100-80gb preset, Selene's). The
# paper's "4 NVLink GPU-to-GPU interconnects per node" is not a datasheet figure; NVLink inside a
# node is left at the A100's.
JEAN_ZAY_A100 = replace(GPUS["a100-80gb"], name="a100-80gb-jean-zay", inter_bandwidth=gbit(400) / 8,
                        source="A100 datasheet; Le Scao et al. 2022 §3.4.1: 4 x 100 Gb/s a node")

# Both pipelines below give the first and the last stage one block fewer, the embedding and the
# output layer (with the loss) taking those places. The planner's stages are uniform (pp divides
# the layers), so these runs are compared as that many block slots: every layout does the same
# 2 blocks' extra work (2.9 % for BLOOM, 1.6 % for Llama 3), and their pp becomes expressible.
OTHER_RUNS = [
    # BLOOM 176B (the training script, bigscience-workshop/bigscience
    # train/tr11-176B-ml/tr11-176B-ml.slurm; Le Scao et al. 2022 §3.4): 48 nodes of 8 A100 80GB,
    # tp 4, pp 12 (dp 8), micro-batch 2, 2048 sequences, bf16 with DeepSpeed's BF16 optimizer
    # (ZeRO-1's sharded optimizer states), full recomputation. Its pipeline balances 72 layers,
    # the 70 blocks and the tied embedding at each end (--pp-partition-method
    # 'type:transformer|embedding'): 6 a stage, the first and the last 5 blocks and an embedding.
    {"name": "bloom-176b", "slots": 72, "gpus": 384, "tp": 4, "pp": 12, "gpu": JEAN_ZAY_A100},
    # Llama 3 405B (Llama Team 2024, "The Llama 3 Herd of Models", Table 4, the 16,384-GPU row of
    # the 8K-context pre-training; §3.3.1-3.3.2): H100 80GB, 8 a server with NVLink, 400 Gb/s
    # RoCE per GPU between servers (the h100-sxm preset), tp 8, cp 1, pp 16, dp 128, 16 sequences
    # per data-parallel rank (2048, 16M tokens, a step), bf16, FSDP, 400 TFLOP/s per GPU. Its
    # pipeline gives the first and the last stage one block fewer (§3.3.2, for memory and compute
    # balance): 16 stages of 8 slots, 126 blocks. The preset's multi-head ring moves 16 times the
    # K/V bytes of Llama 3's 8 heads (refimpl.lab.predict.presets), so every cp > 1 layout is predicted
    # slower than it would be; with cp left out of the search altogether (cp_sizes=(1,)) their
    # grid still ranks in the top five (4th; BLOOM's 5th), so the count does not hang on it.
    {"name": "llama3-405b", "slots": 128, "gpus": 16384, "tp": 8, "pp": 16, "gpu": "h100-sxm"},
]


def published_runs() -> list[dict]:
    """Table 1's ten runs, GPT-3 175B on 1024 GPUs, BLOOM 176B and Llama 3 405B: name, shape,
    batch, GPUs, the GPU they ran on and their (t, p)."""
    runs = [{"name": f"{r['params_b']:g}b", "shape": r["shape"], "global_batch": r["global_batch"],
             "gpus": r["gpus"], "tp": r["tp"], "pp": r["pp"], "gpu": "a100-80gb"}
            for r in megatron_runs()]
    g = GPT3_ON_1024
    runs.append({"name": g["model"], "shape": MODELS[g["model"]][0], "global_batch": g["global_batch"],
                 "gpus": g["gpus"], "tp": g["tp"], "pp": g["pp"], "gpu": "a100-80gb"})
    for r in OTHER_RUNS:
        shape, batch = MODELS[r["name"]]
        runs.append({"name": r["name"], "shape": replace(shape, n_layers=r["slots"]),
                     "global_batch": batch, "gpus": r["gpus"], "tp": r["tp"], "pp": r["pp"],
                     "gpu": r["gpu"]})
    return runs


def published_grid_ranks(runs=None, **space) -> pd.DataFrame:
    """For each published run, its (t, p) grid's rank (0 = the planner's choice) among the best
    layout of every (t, p) with every technique allowed, the planner's best layout, and how much
    slower than it the best layout on their grid is predicted to be. `space` narrows the search."""
    rows = []
    for run in runs or published_runs():
        grids = best_per_grid(plan(**run["shape"].to_dict(), global_batch=run["global_batch"],
                                   gpus=run["gpus"], gpu=run["gpu"], **space), axes=("tp", "pp"))
        match = grids[(grids.tp == run["tp"]) & (grids.pp == run["pp"])]
        best = grids.iloc[0]
        rows.append({"run": run["name"], "their_grid": f"t{run['tp']} p{run['pp']}",
                     "grid_rank": int(match.index[0]) if len(match) else None,
                     "planner_best": (f"dp{best.dp} t{best.tp} p{best.pp} cp{best.cp} "
                                      f"zero{best.zero_stage} b{best.micro_batch_size} "
                                      f"{best.recompute}{' sp' if best.sequence_parallel else ''}"),
                     "slower_than_best": (float(match.step_time_s.iloc[0] / best.step_time_s - 1)
                                          if len(match) else None)})
    return pd.DataFrame(rows)
