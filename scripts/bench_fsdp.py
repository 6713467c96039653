"""Our ZeRO-3 / FSDP against PyTorch's FSDP2 (`fully_shard`): step time and peak memory per rank.

    python scripts/bench_fsdp.py                       # 2 ranks, 12 steps
    python scripts/bench_fsdp.py --nproc 4 --steps 20 --global-batch 16
    python scripts/bench_fsdp.py --memory-only         # the peaks alone (one launch, 3 steps each)

Same model, same global batch, same rows per rank. Two launches:

  timing   every strategy in the same ranks, unprofiled, in the order A B C ... then ... C B A
           (so drift in the machine's load favours nobody); each strategy's step time is the
           median of its steps after the first of each pass, the slowest rank's per step;
  memory   each strategy once more, with the CPU allocator's events recorded: peak per rank =
           model state kept between steps + the most a step allocated on top of it
           (refimpl.lab.trace.memory_events).

Goal: our step time <= 1.1 x fully_shard's with no more peak memory. A benchmark, not a test:
it asserts nothing, and its times move with the machine's load (the ratios much less).
"""
from __future__ import annotations

import argparse
import statistics

import pandas as pd

from refimpl.config import TrainConfig
from refimpl.lab.loop import train_several_on_ranks, train_several_recording_memory
from refimpl.lab.measure.ratio_log import record

# (label, strategy, options, the twin it is compared with)
CONTENDERS = [
    ("torch-fsdp2", "torch-fsdp2", {}, "torch-fsdp2"),
    ("zero3", "zero3", {}, "torch-fsdp2"),
    ("fsdp", "fsdp", {}, "torch-fsdp2"),
    ("fsdp overlap_reduce", "fsdp", {"overlap_reduce": True}, "torch-fsdp2"),
    ("torch-fsdp2-gradop", "torch-fsdp2-gradop", {}, "torch-fsdp2-gradop"),
    ("fsdp grad_op", "fsdp", {"sharding": "grad_op"}, "torch-fsdp2-gradop"),
    ("fsdp grad_op overlap_reduce", "fsdp", {"sharding": "grad_op", "overlap_reduce": True},
     "torch-fsdp2-gradop"),
]


def timing(base: TrainConfig) -> dict[str, float]:
    order = CONTENDERS + CONTENDERS[::-1]
    results = train_several_on_ranks([base.with_(strategy=s, options=o) for _, s, o, _ in order])
    steps: dict[str, list[float]] = {}
    for (label, *_), result in zip(order, results):
        per_step = [max(t) for t in zip(*(r["step_times"] for r in result["per_rank"]))]
        steps.setdefault(label, []).extend(per_step[1:])
    return {label: statistics.median(times) for label, times in steps.items()}


def memory(base: TrainConfig) -> dict[str, dict]:
    cfgs = [base.with_(strategy=s, options=o, steps=3) for _, s, o, _ in CONTENDERS]
    out = {}
    for (label, *_), result in zip(CONTENDERS, train_several_recording_memory(
            cfgs, [True] * len(cfgs))):
        transient = result["transient_peak"]
        kept = [m["params"] + m["grads"] + m["optimizer"] for m in result["memory"]]
        out[label] = {"loss": result["losses"][-1], "model_state": max(kept),
                      "step_peak": max(transient.values()),
                      "peak": max(k + transient[r] for r, k in enumerate(kept))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--memory-only", action="store_true",
                   help="skip the timing launch: peak memory only (step_ms and time_ratio blank)")
    args = p.parse_args()
    base = TrainConfig(nproc=args.nproc, steps=args.steps, global_batch=args.global_batch,
                       seq_len=args.seq_len)
    times = {} if args.memory_only else timing(base)
    mem = memory(base)
    rows = []
    for label, _, _, twin in CONTENDERS:
        m = mem[label]
        rows.append({"strategy": label, "vs": twin, "loss": m["loss"],
                     "step_ms": 1e3 * times.get(label, float("nan")),
                     "time_ratio": times.get(label, float("nan")) / times.get(twin, float("nan")),
                     "model_state_MiB": m["model_state"] / 2**20,
                     "step_peak_MiB": m["step_peak"] / 2**20, "peak_MiB": m["peak"] / 2**20,
                     "peak_ratio": m["peak"] / mem[twin]["peak"]})
    pd.set_option("display.width", 160)
    timed = "no timing" if args.memory_only else f"timing: {args.steps} steps x 2 passes"
    print(f"{args.nproc} ranks, global batch {args.global_batch} x {args.seq_len} tokens, {timed}; "
          f"peaks from 3 steps (per rank: model state kept between steps; step peak = most "
          f"allocated on top during a step, steps 2-3)")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    for row in rows:
        if times:
            record(f"{row['strategy']} / {row['vs']} step time", row["time_ratio"], "<= 1.0",
                   script="bench_fsdp.py")
        record(f"{row['strategy']} / {row['vs']} peak memory", row["peak_ratio"], "<= 1.0", script="bench_fsdp.py")


if __name__ == "__main__":
    main()
