"""Collective bandwidth on this machine, nccl-tests style: torch.distributed vs refimpl.comm.

    python scripts/bench_collectives.py                      # 4 B .. 64 MB, 2 and 4 ranks
    python scripts/bench_collectives.py --max-bytes 256M --world-sizes 2

Prints, per world size, the bus bandwidth (GB/s) of every collective and implementation at a few
sizes, the alpha-beta fit of each, and then the head-to-head that matters most: refimpl's ring
all-reduce against gloo's all_reduce at 16 MB on 2 ranks, alternating call by call (goal: >= 0.9
of gloo's bandwidth). A benchmark, not a test: it asserts nothing and its numbers move with the
machine's load.
"""
from __future__ import annotations

import argparse

import pandas as pd

from refimpl.lab.measure import bench
from refimpl.lab.measure.ratio_log import record


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--min-bytes", type=parse_bytes, default=4)
    p.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    p.add_argument("--factor", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops", nargs="+", default=list(bench.OPS), choices=bench.OPS)
    p.add_argument("--ratio-bytes", type=parse_bytes, default=16 << 20)
    p.add_argument("--ratio-repeats", type=int, default=60)
    p.add_argument("--ratio-worlds", type=int, nargs="+", default=[2, 4],
                   help="world sizes of the ring-vs-gloo head-to-head")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args()

    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 30)
    sizes = bench.message_sizes(args.min_bytes, args.max_bytes, args.factor)
    print(f"memcpy ceiling (one core): {bench.memcpy_bandwidth() / 1e9:.2f} GB/s\n")
    df = bench.sweep(args.world_sizes, args.ops, sizes, repeats=args.repeats,
                     progress=not args.no_progress)
    shown = [s for s in sizes if s in {sizes[0], 1 << 10, 64 << 10, 1 << 20, 16 << 20, sizes[-1]}]
    for n, g in df.groupby("world_size"):
        table = g[g.nominal_bytes.isin(shown)]
        wide = table.pivot_table(index="nominal_bytes", columns=["op", "impl"], values="busbw") / 1e9
        print(f"--- busbw (GB/s), {n} ranks ---")
        print(wide.round(3).to_string(), "\n")
    fits = bench.fit_table(df)
    fits = fits.assign(alpha_us=fits.alpha_s * 1e6, beta_GBps=fits.beta_bytes_per_s / 1e9)
    print("--- alpha-beta fits ---")
    print(fits[["impl", "op", "world_size", "alpha_us", "beta_GBps", "r2_log", "median_rel_err"]]
          .round(3).to_string(index=False), "\n")

    for world in args.ratio_worlds:
        h2h = bench.head_to_head("all_reduce", args.ratio_bytes, world, args.ratio_repeats)
        print(f"--- ring all-reduce vs gloo all_reduce, {args.ratio_bytes / 2**20:.0f} MB, {world} ranks, "
              f"{args.ratio_repeats} alternating calls ---")
        print((h2h[["median_s", "min_s"]] * 1e3).round(2).rename(columns=lambda c: c + " (ms)")
              .join((h2h[["busbw_median", "busbw_best"]] / 1e9).round(3)).to_string())
        median_ratio = h2h.loc["refimpl", "busbw_median"] / h2h.loc["torch", "busbw_median"]
        best_ratio = h2h.loc["refimpl", "busbw_best"] / h2h.loc["torch", "busbw_best"]
        print(f"\nrefimpl / gloo busbw: {median_ratio:.3f} (medians), {best_ratio:.3f} (best calls); "
              f"goal >= 0.9\n")
        record(f"ring all-reduce / gloo busbw ({args.ratio_bytes / 2**20:.0f} MB, {world} ranks, medians)",
               median_ratio, ">= 0.9", script="bench_collectives.py",
               note=f"{args.ratio_repeats} alternating calls")

if __name__ == "__main__":
    main()
