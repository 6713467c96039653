"""How long the training loop waits per checkpoint: asynchronous save against synchronous.

    python scripts/bench_checkpoint.py [--strategy zero3] [--nproc 2] [--saves 4]

Each rank trains `--saves` steps with a save after each (refimpl.lab.checkpoint.run_checkpoint.save),
blocking (the loop waits for the disk) and not (it waits only for the host copy; the background
thread writes), and prints the median wait of each, rank 0's view. Printed, not asserted: the
ratio depends on the disk and the model size. On CPU ranks the two are the same save: a CPU rank
writes its own tensors and waits for the disk (a host copy would sit beside its states in the
same memory: issue 52), so the difference shows on a GPU.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from refimpl import launch
from refimpl.lab.checkpoint import run_checkpoint
from refimpl.lab.config import LabConfig
from refimpl.model import GPTConfig
from refimpl.train import train_rank


def _waits(rank, world_size, cfg, directory):
    """Train with a save after every step, once blocking and once not, timing each save."""
    save, out = run_checkpoint.save, {}
    for blocking in (True, False):
        waits = []

        def timed(*a, **kw):
            start = time.perf_counter()
            path = save(*a, **kw, blocking=blocking)
            waits.append(time.perf_counter() - start)
            return path
        run_checkpoint.save = timed                  # this rank's process only
        mode = "sync" if blocking else "async"
        train_rank(rank, world_size, cfg.with_(checkpoint_dir=f"{directory}/{mode}"))
        out[mode] = statistics.median(waits)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="zero3")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    args = p.parse_args()
    cfg = LabConfig(strategy=args.strategy, nproc=args.nproc, steps=args.saves,
                    checkpoint_every=1, global_batch=4,
                    model=GPTConfig(vocab_size=512, seq_len=32, d_model=args.d_model,
                                      n_heads=4, n_layers=4))
    with tempfile.TemporaryDirectory() as d:
        waits = launch.run(_waits, args.nproc, cfg, d)[0]
    print(f"{args.strategy} on {args.nproc} ranks: wait per save, sync {waits['sync'] * 1e3:.1f} ms, "
          f"async {waits['async'] * 1e3:.1f} ms ({waits['sync'] / waits['async']:.1f}x less)")


if __name__ == "__main__":
    main()
