"""The planner's memory beside the dry run's for the grid of 7B and 70B layouts (refimpl.lab.plan.
against_dryrun.GRID), one CPU process per layout's rank 0, on meta tensors.

    python scripts/dryrun_vs_plan.py            # every layout (~1 min on one core: 7B ~1 s, 70B 2-10 s each)
    python scripts/dryrun_vs_plan.py 0 9        # the layouts at these indices of GRID

Prints one line per layout (GiB ran, relative error of the planner per category) and exits 1 if
model states differ by more than 1 % or the peak by more than 10 %.
"""
from __future__ import annotations

import sys
import time
import warnings

from refimpl.config import TrainConfig
from refimpl.lab.plan.against_dryrun import CATEGORIES, GRID, compare

STATES, PEAK = ("params", "grads", "optimizer"), "peak"


def main(indices) -> int:
    warnings.filterwarnings("ignore")
    bad = 0
    print("layout".ljust(58) + "".join(f"{c[:10]:>18s}" for c in CATEGORIES) + "   wall")
    for i in indices:
        preset, kw = GRID[i]
        start = time.perf_counter()
        row = compare(preset, TrainConfig(**kw))
        name = (f"{i:2d} {preset} {row['strategy']} n{row['nproc']} dp{row['dp']} tp{row['tp']} "
                f"pp{row['pp']} cp{row['cp']}" + (" sp" if row["sp"] else "")
                + (" ckpt" if row["recompute"] == "full" else ""))
        cells = "".join(f"{row[f'{c}_ran'] / 2**30:9.2f} {row[f'{c}_err']:+7.1%} " for c in CATEGORIES)
        print(f"{name:58s}{cells} {time.perf_counter() - start:5.0f}s", flush=True)
        bad += any(abs(row[f"{c}_err"]) > 0.01 for c in STATES) or abs(row[f"{PEAK}_err"]) > 0.10
    print(f"{bad} layout(s) outside the gates (states 1 %, peak 10 %)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or range(len(GRID))))
