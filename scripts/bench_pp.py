"""Benchmark: our pipeline runner against PyTorch's `torch.distributed.pipelining`, in one launch.

    .venv/bin/python scripts/bench_pp.py                          # 2 stages, every schedule both have
    .venv/bin/python scripts/bench_pp.py --schedules zbv,dualpipev --micro-batches 8
    .venv/bin/python scripts/bench_pp.py --nproc 4 --micro-batches 8 --layers 8

Both sides run the same stages (refimpl.parallel.pp.stage), the same batches, on the same ranks.
Rounds alternate ours, theirs, theirs, ours, ... (who goes first takes turns, so neither side
always finds the machine as the other left it) and a slow spell of the machine hits both; a side's
step time is the median over its steps after each round's first (the slowest rank per step).
Prints per schedule: loss of each side, median step times, the ratio ours / theirs, and the bubble
the table predicts. Not a test: timings depend on the machine.

On a shared machine (more runnable processes than cores) the wall clock also counts the time a rank
waits for a core, and the ratio moves by 10-30 % from run to run. Beside it, each step's CPU time of
the rank's process (`time.process_time`, the slowest rank): the compute, the Python dispatch and
gloo's copies of the messages, whichever thread makes them, but not the waits, so it does not see
the bubble, and it moves much less with the load. Read both, with `uptime`.

Why the whole process and not the main thread alone. gloo copies a message on the thread that
finds the socket ready: the sender's main thread when the receiver has already posted its receive,
gloo's own thread otherwise. Our runner posts a step's receives at its start and PyTorch's just
before each action, so the same bytes were copied on our main threads and on PyTorch's gloo
threads: measured on 2 stages, gpipe, the last stage's main thread spent 104.1 ms per step in ours
against 100.1 in PyTorch's (ratio 1.04), while the whole process spent 105.0 against 104.1 (1.01).
The main thread's time charged one side for copies the other made elsewhere.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

from refimpl.lab.measure.ratio_log import record
from refimpl.lab.twins.torch_pp import TWIN_SCHEDULES, TorchPipeline, check_torch_layout
from refimpl.launch import device_for, run
from refimpl.model import GPTConfig, build_model, synthetic_batch
from refimpl.parallel.pp.runner import run_schedule
from refimpl.parallel.pp.schedules import bubble_fraction, chunks_per_rank, placement, schedule_table
from refimpl.parallel.pp.stage import build_chunks


def chunks_of(schedule, args) -> int:
    """Chunks per rank: --virtual-stages for the interleaved ones, 2 on a V, else 1."""
    return args.virtual_stages if schedule.startswith("interleaved") else chunks_per_rank(schedule)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--virtual-stages", type=int, default=2, help="for interleaved")
    p.add_argument("--schedules", default=",".join(TWIN_SCHEDULES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=160)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=6, help="steps per round (the first is warm-up)")
    p.add_argument("--rounds", type=int, default=8,
                   help="even: each side goes first as often (fewer: the CPU ratio moves by +-3 %%)")
    return p.parse_args(argv)


def bench_rank(rank, world, args, schedules):
    """Every (schedule, side) in rounds; returns {(schedule, side): ([(step seconds, the process's
    CPU seconds)], last loss)}."""
    group = dist.new_group(list(range(world)))
    cfg = GPTConfig(n_layers=args.layers, d_model=args.d_model, seq_len=args.seq_len)
    device = device_for(dist.get_backend())     # the rank's GPU under NCCL: it refuses CPU tensors
    out = {}
    for round_ in range(args.rounds):
        for schedule in schedules:
            v, where = chunks_of(schedule, args), placement(schedule)
            # who goes first takes turns: the side that follows the other's round finds the
            # allocator and the caches as the other left them (measured: 2-10 % on the first side)
            for side in ("ours", "torch") if round_ % 2 == 0 else ("torch", "ours"):
                chunks = build_chunks(build_model(cfg, 0).to(device), world, rank, v, where=where)
                if side == "torch":
                    pipe = TorchPipeline(chunks, group, world, schedule, args.micro_batches, device=device)
                    step = pipe.step
                else:
                    table = schedule_table(world, args.micro_batches, schedule, v)
                    step = lambda b, table=table, chunks=chunks: run_schedule(
                        chunks, table, b.micro_batches(args.micro_batches), group, where=where)
                times, loss = [], None
                for s in range(args.steps):
                    batch = synthetic_batch(cfg, args.global_batch, args.seq_len, 0, s).to(device)
                    dist.barrier(group)
                    start, cpu = time.perf_counter(), time.process_time()
                    loss = step(batch)
                    dist.barrier(group)
                    times.append((time.perf_counter() - start, time.process_time() - cpu))
                    for c in chunks:
                        c.zero_grad(set_to_none=True)
                prev = out.get((schedule, side), ([], None))[0]
                # a float, read after the timed steps: a device tensor would travel back to the launcher
                out[(schedule, side)] = (prev + times[1:], None if loss is None else float(loss))
    return out


def main(argv=None) -> int:
    args = parse(argv)
    schedules = args.schedules.split(",")
    for s in schedules:
        check_torch_layout(args.nproc, args.micro_batches, s, chunks_of(s, args))
    ranks = run(bench_rank, args.nproc, args, schedules, timeout=1800)
    print(f"{args.nproc} stages, {args.micro_batches} micro-batches, {args.layers} blocks of d={args.d_model}, "
          f"batch {args.global_batch} x seq {args.seq_len}, {args.rounds} rounds x {args.steps - 1} timed steps")
    print(f"{'schedule':<15} {'bubble':>7} {'loss ours':>10} {'loss torch':>10} {'ours ms':>9} "
          f"{'torch ms':>9} {'ours/torch':>10} {'cpu ours':>9} {'cpu torch':>9} {'cpu o/t':>8}")
    for s in schedules:
        v = chunks_of(s, args)
        med, cpu = {}, {}
        for side in ("ours", "torch"):
            steps = list(zip(*(r[(s, side)][0] for r in ranks)))    # per step: every rank's
            med[side] = statistics.median(max(t[0] for t in ts) for ts in steps)   # slowest rank
            cpu[side] = statistics.median(max(t[1] for t in ts) for ts in steps)
        last = 0 if placement(s) == "v" else -1           # the rank with the loss
        loss = {side: ranks[last][(s, side)][1] for side in ("ours", "torch")}
        print(f"{s:<15} {bubble_fraction(args.nproc, args.micro_batches, s, v):>7.3f} {loss['ours']:>10.6f} "
              f"{loss['torch']:>10.6f} {med['ours'] * 1e3:>9.2f} {med['torch'] * 1e3:>9.2f} "
              f"{med['ours'] / med['torch']:>10.3f} {cpu['ours'] * 1e3:>9.2f} {cpu['torch'] * 1e3:>9.2f} "
              f"{cpu['ours'] / cpu['torch']:>8.3f}")
        where = f"{args.nproc} stages, {args.micro_batches} micro-batches"
        record(f"pp {s} / torch step time ({args.nproc} stages)", med["ours"] / med["torch"], "<= 1.0",
               script="bench_pp.py", note=where)
        record(f"pp {s} / torch CPU time ({args.nproc} stages)", cpu["ours"] / cpu["torch"], "<= 1.0",
               script="bench_pp.py", note=where)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
