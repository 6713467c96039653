"""Benchmark: the planner's predicted step time against the measured one, for every layout the loop
runs on this machine's CPU ranks (issue: "the predicted ranking of the layouts must match").

    .venv/bin/python scripts/bench_plan_cpu.py                    # 4 ranks, 2 rounds x 3 timed steps
    .venv/bin/python scripts/bench_plan_cpu.py --rounds 3 --margin 0.25 --csv /tmp/plan_cpu.csv

First the CPU preset is measured here (refimpl.lab.plan.cpu.calibrated_cpu_preset: the alpha-beta fit
of an all-reduce on the same number of ranks, memcpy bandwidth, compute fitted to `single`'s own
step), then every layout is predicted and run in one launch, interleaved in rounds, and the table
is printed fastest-measured first with the prediction's parts. The verdict line gives Spearman's
rank correlation and the pairs the prediction orders the wrong way although their measured times
differ by more than --margin (closer pairs are within the machine's own spread). Exit status 1 if
Spearman's rho is below --min-spearman. Not a test: wall time depends on the machine and its load
(printed with the figures); run it on a quiet one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import pandas as pd

from refimpl.lab.plan.cpu import (
    calibrated_cpu_preset,
    comparison_view,
    cpu_layouts,
    layout_name,
    measure_cpu_layouts,
    ranking_agreement,
)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="steps per round (the first is warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--margin", type=float, default=0.3,
                   help="pairs whose measured times differ by more than this fraction must keep "
                        "their predicted order")
    p.add_argument("--min-spearman", type=float, default=0.9)
    p.add_argument("--no-checkpointing", action="store_true",
                   help="leave out the activation-checkpointing variants (half the layouts)")
    p.add_argument("--csv", help="also write the table here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    start, load_before = time.perf_counter(), os.getloadavg()
    hw = calibrated_cpu_preset(world_size=args.nproc)
    recompute = ("none",) if args.no_checkpointing else ("none", "full")
    table = cpu_layouts(hw, world_size=args.nproc, recompute=recompute)
    table = measure_cpu_layouts(table, world_size=args.nproc, steps=args.steps, rounds=args.rounds)
    table.insert(0, "layout", [layout_name(row) for _, row in table.iterrows()])
    agreement = ranking_agreement(table.step_time_s, table.measured_step_time_s, args.margin)

    ms = lambda s: s * 1e3   # noqa: E731
    print(f"{args.nproc} CPU ranks; the preset {hw.source}: matmul {hw.matmul_rate / 1e9:.1f} GFLOP/s per "
          f"core, {ms(hw.block_overhead_s):.2f} ms per block pass, alpha {ms(hw.intra_alpha):.2f} ms "
          f"per ring step, beta {hw.intra_bandwidth / 1e9:.2f} GB/s; {args.rounds} rounds x "
          f"{args.steps - 1} timed steps, {time.perf_counter() - start:.0f} s in all; load average "
          f"(1, 5, 15 min) {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f} before, "
          "{:.1f} {:.1f} {:.1f} after on {} cores".format(*os.getloadavg(), os.cpu_count()))
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(comparison_view(table).to_string(index=False))
    names = table.layout
    print(f"Spearman {agreement['spearman']:.3f}; predicted fastest is the measured fastest: "
          f"{agreement['same_fastest']}; median |error| {agreement['median_rel_error']:.0%}, "
          f"max {agreement['max_rel_error']:.0%}; {len(agreement['misordered'])} of "
          f"{len(table) * (len(table) - 1) // 2} pairs more than {args.margin:.0%} apart are misordered")
    for a, b in agreement["misordered"]:
        print(f"  misordered: {names[a]} ({ms(table.measured_step_time_s[a]):.0f} ms measured, "
              f"{ms(table.step_time_s[a]):.0f} predicted) vs {names[b]} "
              f"({ms(table.measured_step_time_s[b]):.0f}, {ms(table.step_time_s[b]):.0f})")
    if args.csv:
        table.drop(columns=["command"]).to_csv(args.csv, index=False)
    return 0 if agreement["spearman"] >= args.min_spearman else 1


if __name__ == "__main__":
    sys.exit(main())
