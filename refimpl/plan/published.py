"""The planner against published trainings: Narayanan et al. 2021, Table 1 (refimpl.plan.models).

`compare_with_megatron()` searches, for each of the ten runs, the layouts their techniques allowed
(TECHNIQUES_2021: tensor + pipeline + data parallelism, full recomputation, no ZeRO, no sequence
or context parallelism) on the same model, GPU count and batch, and reports where their (t, p)
grid ranks among the planner's grids, how much slower the planner predicts it to be than its own
best, and the predicted vs the measured teraFLOP/s per GPU. With every technique allowed, it also
reports the planner's best layout and its predicted speed-up over theirs.
"""
from __future__ import annotations

import pandas as pd

from refimpl.plan.models import megatron_runs
from refimpl.plan.search import best_per_grid, plan

TECHNIQUES_2021 = dict(zero_stages=(0,), recompute=("full",), sequence_parallel=(False,),
                       cp_sizes=(1,))


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
