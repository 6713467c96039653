"""Checkpoints a run writes as it goes, and resumes from: the seed's fault tolerance (장애 허용).

More devices mean more failures, so a long run saves its whole state every K steps and a restarted
job (torchrun --max-restarts, a Slurm requeue) continues from the last one instead of step 0:

    python -m refimpl train --strategy zero1 --tp 2 --steps 20 --checkpoint-every 5 --checkpoint-dir D

What one checkpoint holds (`capture`), all in the reference's names and full shapes, so that it loads
under any layout (the resharding of refimpl.verify.reshard and refimpl.compose.optim_reshard):
  weights     the full state dict (placement.gather_full_state_dict through the strategy)
  optimizer   AdamW's m, v and step (optim_reshard.full_optimizer_state)
  step        the data position: batches are a function of (seed, step) (model.data), so the
              next step's batch is `synthetic_batch(..., step)` whatever the layout
  losses      the losses so far, so the resumed run reports the whole run
  rng         rank 0's CPU (and CUDA) generator state, set on every rank when it resumes (every
              rank seeds the same way, so they share it)
  run         what must match to resume (model, batch, seed, lr, dtype): a mismatch is refused

Atomic by rename (`write_atomically`): the bytes go to a hidden temporary file in the same
directory, are flushed to disk (fsync), and only then renamed to `step-00000010.pt`; rename within
one file system is atomic (POSIX rename(2)), so a crash mid-save leaves the previous checkpoint and
at worst a stray temporary file, never a truncated checkpoint under a checkpoint's name. Only rank
0 writes; under several nodes, D must be a file system every node sees (the resume reads it on
every rank's node, and rank 0 decides which step all of them load).
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from refimpl.compose.optim_reshard import full_optimizer_state, load_optimizer_state
from refimpl.mesh import LayoutError

FORMAT = 1
KEEP = 2                                   # the newest two: one may be read while the next is written
_NAME = re.compile(r"^step-(\d{8})\.pt$")  # temporaries start with "." and never match
# What a resumed run must share with the run that wrote the checkpoint: the layout may change, the
# maths may not.
RUN_KEYS = ("global_batch", "seq_len", "seed", "lr", "weight_decay", "dtype", "mixed_precision")


def checkpoint_path(directory, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def latest_checkpoint(directory) -> Path | None:
    """The checkpoint of the highest step in `directory` (None: none there, or no directory)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = [int(m.group(1)) for m in map(_NAME.match, os.listdir(directory)) if m]
    return checkpoint_path(directory, max(steps)) if steps else None


def run_identity(cfg) -> dict:
    return {"model": asdict(cfg.model), **{k: getattr(cfg, k) for k in RUN_KEYS}}


def check_resumable(cfg) -> None:
    """Before launch: a checkpoint in --checkpoint-dir that this run cannot continue fails here."""
    path = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if path is None:
        return
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:   # a file under a checkpoint's name is whole (renamed), unless tampered
        raise LayoutError(f"--checkpoint-dir: {path} cannot be read ({type(e).__name__})") from None
    if saved.get("format") != FORMAT:
        raise LayoutError(f"--checkpoint-dir: {path} has format {saved.get('format')}, "
                          f"this refimpl reads {FORMAT}")
    if saved["step"] > cfg.steps:
        raise LayoutError(f"--checkpoint-dir: {path.name} is at step {saved['step']}, beyond "
                          f"--steps {cfg.steps}")
    mine = run_identity(cfg)
    for key, value in saved["run"].items():
        if mine.get(key) != value:
            raise LayoutError(f"--checkpoint-dir: {path.name} was written with {key}={value!r}, "
                              f"this run has {key}={mine.get(key)!r} (only the layout may change)")


def write_atomically(obj, path) -> None:
    """torch.save to a temporary name beside `path`, fsync, rename: `path` is whole or absent."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)   # the rename itself reaches the disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def capture(strategy, step: int, losses: list[float]) -> dict:
    """The run's state after `step` steps, whole. Collective: every rank calls it."""
    cpu = {k: v.detach().cpu() for k, v in strategy.full_state_dict().items()}
    optimizer = full_optimizer_state(strategy)
    optimizer = {k: (v if k == "step" else {n: t.detach().cpu() for n, t in v.items()})
                 for k, v in optimizer.items()}
    return {"format": FORMAT, "step": step, "losses": list(losses), "weights": cpu,
            "optimizer": optimizer, "rng": _rng_state(strategy.ctx.device),
            "run": run_identity(strategy.ctx.cfg)}


def save(strategy, step: int, losses: list[float], directory) -> Path:
    """Every rank gathers; rank 0 writes step-<step>.pt atomically and keeps the newest KEEP."""
    state = capture(strategy, step, losses)
    path = checkpoint_path(directory, step)
    if strategy.ctx.rank == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        write_atomically(state, path)
        for m in sorted(filter(None, map(_NAME.match, os.listdir(directory))),
                        key=lambda m: int(m.group(1)))[:-KEEP]:
            (Path(directory) / m.group(0)).unlink(missing_ok=True)
    return path


def load_latest(directory) -> dict | None:
    """The checkpoint every rank resumes from: rank 0 picks the step (one broadcast), so ranks on
    nodes that listed the directory at different moments still load the same one."""
    if not directory:           # no --checkpoint-dir: no collective either
        return None
    path = latest_checkpoint(directory)
    if dist.is_initialized():
        chosen = [str(path) if path else None]
        dist.broadcast_object_list(chosen, src=0)
        path = Path(chosen[0]) if chosen[0] else None
    if path is None:
        return None
    # memory-mapped: each tensor is read when a rank places its part of it (refimpl.rank_values)
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def restore(strategy, saved: dict) -> None:
    """AdamW's state and the generator, after the strategy placed the checkpoint's weights."""
    load_optimizer_state(strategy, saved["optimizer"])
    torch.set_rng_state(saved["rng"]["cpu"])
    if "cuda" in saved["rng"] and strategy.ctx.device.type == "cuda":
        torch.cuda.set_rng_state(saved["rng"]["cuda"], strategy.ctx.device)
