"""The planner against published trainings: Narayanan et al. 2021, Table 1 (refimpl.plan.models).

`compare_with_megatron()` searches, for each of the ten runs, the layouts their techniques allowed
(TECHNIQUES_2021: tensor + pipeline + data parallelism, full recomputation, no ZeRO, no sequence
or context parallelism) on the same model, GPU count and batch, and reports where their (t, p)
grid ranks among the planner's grids, how much slower the planner predicts it to be than its own
best, and the predicted vs the measured teraFLOP/s per GPU. With every technique allowed, it also
reports the planner's best layout and its predicted speed-up over theirs.

`published_grid_ranks()` asks today's question of the same eleven runs (Table 1 and GPT-3 175B on
1024 GPUs, Narayanan et al. §5.1): with every technique allowed (ZeRO, sequence and context
parallelism, selective recomputation, bf16), where does their (t, p) rank among the planner's
best layout of each (t, p)?
"""
from __future__ import annotations

import pandas as pd

from refimpl.plan.models import GPT3_ON_1024, MODELS, megatron_runs
from refimpl.plan.search import best_per_grid, plan

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


def published_runs() -> list[dict]:
    """Table 1's ten runs and GPT-3 175B on 1024 GPUs: name, shape, batch, GPUs and their (t, p)."""
    runs = [{"name": f"{r['params_b']:g}b", "shape": r["shape"], "global_batch": r["global_batch"],
             "gpus": r["gpus"], "tp": r["tp"], "pp": r["pp"]} for r in megatron_runs()]
    g = GPT3_ON_1024
    runs.append({"name": g["model"], "shape": MODELS[g["model"]][0],
                 "global_batch": g["global_batch"], "gpus": g["gpus"], "tp": g["tp"], "pp": g["pp"]})
    return runs


def published_grid_ranks(runs=None, **space) -> pd.DataFrame:
    """For each published run, its (t, p) grid's rank (0 = the planner's choice) among the best
    layout of every (t, p) with every technique allowed, the planner's best layout, and how much
    slower than it the best layout on their grid is predicted to be. `space` narrows the search."""
    rows = []
    for run in runs or published_runs():
        grids = best_per_grid(plan(**run["shape"].to_dict(), global_batch=run["global_batch"],
                                   gpus=run["gpus"], **space), axes=("tp", "pp"))
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
