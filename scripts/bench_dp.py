"""Benchmark: our data-parallel strategies against PyTorch's built-in twins, in one launch.

    .venv/bin/python scripts/bench_dp.py                     # dp vs torch-ddp, zero1 vs torch-zero1
    .venv/bin/python scripts/bench_dp.py --global-batch 16 --seq-len 64 --rounds 5

Every configuration runs on the same ranks (refimpl.lab.loop.train_several_on_ranks), same model,
same seed, same batches, same bucket size. Pairs are interleaved in rounds (ours, theirs, ours,
theirs, ...) so that a slow spell of the machine hits both sides; a strategy's step time is the
median over all its rounds' steps after each round's warm-up step (slowest rank per step).

Prints, per strategy: final loss, per-rank model-state memory (MiB), median step time, and the
ratio ours / theirs. The goal for `dp` is <= 1.05x DDP. Not a test: timings depend on the machine.
"""
from __future__ import annotations

import argparse
import sys

from refimpl.config import TrainConfig
from refimpl.lab.measure.ratio_log import record
from refimpl.lab.verify.step_time import step_times_in_rounds

PAIRS = [("dp", "torch-ddp"), ("zero1", "torch-zero1")]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="steps per round (the first is warm-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--pairs", default="dp:torch-ddp,zero1:torch-zero1",
                   help="comma-separated ours:theirs pairs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    names = [name for pair in pairs for name in pair]
    base = TrainConfig(nproc=args.nproc, steps=args.steps, global_batch=args.global_batch,
                       seq_len=args.seq_len, options={"bucket_mb": args.bucket_mb})
    median, last = step_times_in_rounds({name: base.with_(strategy=name) for name in names},
                                        args.rounds)

    mib = 2 ** 20
    print(f"{args.nproc} ranks, global batch {args.global_batch} x seq {args.seq_len}, "
          f"bucket {args.bucket_mb} MiB, {args.rounds} rounds x {args.steps - 1} timed steps")
    header = ["strategy", "final loss", "params", "grads", "optimizer", "median step"]
    print(f"{header[0]:<12} {header[1]:>10}  " + "  ".join(f"{h:>13}" for h in header[2:5])
          + f"  {header[5]:>11}")
    print(f"{'':<12} {'':>10}  " + "  ".join(f"{'MiB, r0 / r1':>13}" for _ in range(3)))
    for name in names:
        mem = last[name]["memory"]
        cols = [" / ".join(f"{m[k] / mib:.2f}" for m in mem[:2])
                for k in ("params", "grads", "optimizer")]
        loss = last[name]["losses"][-1]
        print(f"{name:<12} {loss:>10.6f}  " + "  ".join(f"{c:>13}" for c in cols)
              + f"  {median[name] * 1e3:>8.2f} ms")
    for ours, theirs in pairs:
        same = last[ours]["losses"] == last[theirs]["losses"]
        print(f"{ours} / {theirs}: step time ratio {median[ours] / median[theirs]:.3f}; "
              f"losses {'identical' if same else 'differ'}")
        record(f"{ours} / {theirs} step time", median[ours] / median[theirs],
               "<= 1.05" if ours == "dp" else "<= 1.0", script="bench_dp.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
