"""Benchmark: our composed dp x tp (`fsdp --tp T`, `zero1 --tp T`) against PyTorch's composed twin
(`torch-fsdp2-tp`: FSDP2 over dp + DTensor TP over tp on one 2-D DeviceMesh), in one launch.

    .venv/bin/python scripts/bench_composition.py                  # 4 ranks: dp 2 x tp 2
    .venv/bin/python scripts/bench_composition.py --nproc 8 --tp 2 --rounds 2

All configurations run on the same ranks (refimpl.lab.loop.train_several_on_ranks), interleaved in
rounds so a slow spell of the machine hits every one; a configuration's step time is the median
over its rounds' steps after each round's warm-up step (slowest rank per step). Prints final loss,
rank 0's parameter memory, the median step and the ratio ours / theirs. Not a test: timings
depend on the machine.
"""
from __future__ import annotations

import argparse
import sys

from refimpl.config import TrainConfig
from refimpl.lab.measure.ratio_log import record
from refimpl.lab.verify.step_time import step_times_in_rounds

VARIANTS = (("fsdp", False), ("torch-fsdp2-tp", False), ("fsdp", True), ("torch-fsdp2-tp", True),
            ("zero1", False))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="steps per round (the first is warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    base = TrainConfig(nproc=args.nproc, tp=args.tp, steps=args.steps,
                       global_batch=args.global_batch, seq_len=args.seq_len)
    median, last = step_times_in_rounds(
        {(name, sp): base.with_(strategy=name, sequence_parallel=sp) for name, sp in VARIANTS},
        args.rounds)
    mib = 2 ** 20
    print(f"{args.nproc} ranks: dp {args.nproc // args.tp} x tp {args.tp}, global batch "
          f"{args.global_batch} x seq {args.seq_len}, {args.rounds} rounds x {args.steps - 1} steps")
    print(f"{'strategy':<15} {'SP':>3} {'final loss':>11} {'params MiB':>11} {'median step':>12}")
    for name, sp in VARIANTS:
        r = last[(name, sp)]
        print(f"{name:<15} {'yes' if sp else 'no':>3} {r['losses'][-1]:>11.6f} "
              f"{r['memory'][0]['params'] / mib:>11.2f} {median[(name, sp)] * 1e3:>9.2f} ms")
    for sp in (False, True):
        ours, theirs = last[("fsdp", sp)], last[("torch-fsdp2-tp", sp)]
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"]))
        print(f"fsdp --tp / torch-fsdp2-tp{' (SP)' if sp else ''}: step time ratio "
              f"{median[('fsdp', sp)] / median[('torch-fsdp2-tp', sp)]:.3f}; "
              f"worst loss rel. diff {worst:.1e}")
        record(f"fsdp --tp / torch-fsdp2-tp{' (SP)' if sp else ''} step time",
               median[("fsdp", sp)] / median[("torch-fsdp2-tp", sp)], "<= 1.0", script="bench_composition.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
