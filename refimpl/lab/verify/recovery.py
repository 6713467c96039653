"""A rank lost mid-run, on purpose: the failure that recovery (refimpl.lab.checkpoint.run_checkpoint) is for.

    lost = train_until_killed(cfg.with_(checkpoint_every=2, checkpoint_dir=d), kill_after=4)
    resumed = train_on_ranks(other_layout.with_(checkpoint_dir=d))   # continues from step 4

`train_until_killed` trains `cfg` on its ranks; right after the checkpoint of step `kill_after` is
on disk, rank 0 sends itself SIGKILL, as `kill -9 <pid>` would: no Python cleanup, no flushing,
the process is gone. The launcher sees a rank die and kills the others (refimpl.launch), so the
job ends the way a lost node ends it, and what survives is the checkpoint directory. Restarting
is then what torchrun --max-restarts or a Slurm requeue does: the same command again (here, any
layout), which finds the checkpoint and resumes. scripts/launch_check.py does the same under a real
torchrun, killing a rank from outside.
"""
from __future__ import annotations

import os
import signal

from refimpl import launch
from refimpl.config import TrainConfig
from refimpl.lab.checkpoint import run_checkpoint
from refimpl.lab.config import lab_config
from refimpl.train import train_rank, validate


def _train_and_die(rank: int, world_size: int, cfg: TrainConfig, kill_after: int):
    save = run_checkpoint.save

    def save_then_die(strategy, step, losses, directory):
        path = save(strategy, step, losses, directory, blocking=True)
        if rank == 0 and step == kill_after:   # rank 0 wrote it (atomically): now it is lost
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    run_checkpoint.save = save_then_die        # this rank's process only
    return train_rank(rank, world_size, cfg)


def train_until_killed(cfg: TrainConfig, kill_after: int, timeout: float = 300.0) -> str:
    """Train until rank 0 is SIGKILLed after checkpoint `kill_after`; returns how the launch
    ended (the launcher's one line: which rank, which signal). Raises if the run survived."""
    cfg = lab_config(cfg)
    validate(cfg)
    if not (cfg.checkpoint_every and kill_after % cfg.checkpoint_every == 0
            and 0 < kill_after < cfg.steps):
        raise ValueError(f"kill_after={kill_after} must be a checkpointed step before the last")
    try:
        launch.run(_train_and_die, cfg.nproc, cfg, kill_after, timeout=timeout, quiet=True)
    except launch.RankFailedError as e:
        return str(e).splitlines()[1]
    raise RuntimeError("the run finished: no rank was killed")
