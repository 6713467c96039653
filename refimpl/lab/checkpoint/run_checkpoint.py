"""Checkpoints a run writes as it goes, and resumes from: the seed's fault tolerance (장애 허용).

More devices mean more failures, so a long run saves its whole state every K steps and a restarted
job (torchrun --max-restarts, a Slurm requeue) continues from the last one instead of step 0:

    python -m refimpl train --strategy zero1 --tp 2 --steps 20 --checkpoint-every 5 --checkpoint-dir D

What one checkpoint holds, as a directory step-<step>/ (refimpl.lab.checkpoint.sharded_checkpoint):
  rank-NNNNN.safetensors  each rank's pieces of the weights and of AdamW's m, v it owns, in the
              reference's names, each a box of the reference's tensor (a piece several ranks hold
              is written once); rank 0's also holds its CPU (and CUDA) generator state, set on
              every rank when it resumes (every rank seeds the same way, so they share it)
  index.json  every tensor's global shape, dtype and pieces; the step (the data position:
              batches are a function of (seed, step), refimpl.model.data), AdamW's step count,
              the losses so far, and what must match to resume (model, batch, seed, lr, dtype)
A resumed run under any layout reads only the boxes each rank places. PyTorch's twins write
torch.distributed.checkpoint's files instead of the rank files (refimpl.lab.checkpoint.dcp_checkpoint:
index.json says "format": "dcp"), into the same directories, made atomic the same way; a run
resumes only from its own kind (a twin from DCP, ours from ours).

Atomic by rename: the ranks write into a hidden temporary directory (each file to a temporary
name, fsync, rename); rank 0, once every rank's file is there, writes the index and renames the
directory to step-<step> (POSIX rename(2) is atomic within one file system), so a crash mid-save
leaves the previous checkpoint and at worst a stray temporary directory. Asynchronous on a GPU:
`save` copies the pieces to pinned host memory and a background thread writes them; the next
save, and the end of the run, `wait` for it. On the CPU the copy would double the rank's states
in the same memory, so the rank writes its own tensors before it goes on. Under several nodes,
D must be a file system every node sees (every rank writes there; rank 0 decides which step all
of them load).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from refimpl.lab.checkpoint import dcp_checkpoint
from refimpl.lab.checkpoint.optim_reshard import _holders, load_optimizer_state, validate_optimizer_state
from refimpl.lab.checkpoint.sharded_checkpoint import (
    INDEX,
    ShardedCheckpoint,
    dedupe,
    fsync_dir,
    rank_file,
    rank_pieces,
    write_file_atomically,
)
from refimpl.lab.twins.base import through_dcp
from refimpl.mesh import LayoutError

FORMAT = 2                                 # 2: sharded (refimpl.lab.checkpoint.sharded_checkpoint)
KEEP = 2                                   # the newest two: one may be read while the next is written
_NAME = re.compile(r"^step-(\d{8})$")      # temporaries start with "." and never match
# What a resumed run must share with the run that wrote the checkpoint: the layout may change, the
# maths may not.
RUN_KEYS = ("global_batch", "seq_len", "seed", "lr", "weight_decay", "dtype", "mixed_precision")


def checkpoint_path(directory, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def latest_checkpoint(directory) -> Path | None:
    """The checkpoint of the highest step in `directory` (None: none there, or no directory)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = [int(m.group(1)) for m in map(_NAME.match, os.listdir(directory)) if m]
    return checkpoint_path(directory, max(steps)) if steps else None


def run_identity(cfg) -> dict:
    return {"model": asdict(cfg.model), **{k: getattr(cfg, k) for k in RUN_KEYS}}


def validate_checkpointing(cfg, strategy_cls) -> None:
    """Before launch: --checkpoint-dir for a strategy that cannot save and resume, or with a
    checkpoint there this run cannot continue, fails here in one line."""
    if through_dcp(strategy_cls):
        why = dcp_checkpoint.refusal(cfg, strategy_cls)
        if why is not None:
            raise LayoutError(f"--checkpoint-dir: {why}")
    else:
        validate_optimizer_state(cfg, "--checkpoint-dir")
    check_resumable(cfg, dcp_checkpoint.FORMAT if through_dcp(strategy_cls)
                    else FORMAT)


def check_resumable(cfg, expected=FORMAT) -> None:
    """Before launch: a checkpoint in --checkpoint-dir that this run cannot continue fails here
    (`expected`: the format this run's strategy reads)."""
    path = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if path is None:
        return
    try:
        saved = json.loads((path / INDEX).read_text())
    except Exception as e:   # a directory under a checkpoint's name is whole (renamed), unless tampered
        raise LayoutError(f"--checkpoint-dir: {path} cannot be read ({type(e).__name__})") from None
    if saved.get("format") != expected:
        raise LayoutError(f"--checkpoint-dir: {path} has format {saved.get('format')!r}, "
                          f"{cfg.strategy!r} reads {expected!r} (refimpl's sharded format is "
                          f"{FORMAT!r}, PyTorch's twins' torch.distributed.checkpoint 'dcp')")
    if saved["step"] > cfg.steps:
        raise LayoutError(f"--checkpoint-dir: {path.name} is at step {saved['step']}, beyond "
                          f"--steps {cfg.steps}")
    mine = json.loads(json.dumps(run_identity(cfg)))      # as JSON keeps it (tuples are lists)
    for key, value in saved["run"].items():
        if mine.get(key) != value:
            raise LayoutError(f"--checkpoint-dir: {path.name} was written with {key}={value!r}, "
                              f"this run has {key}={mine.get(key)!r} (only the layout may change)")


def _rng_state(device: torch.device) -> dict:
    state = {"rng/cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["rng/cuda"] = torch.cuda.get_rng_state(device)
    return state


def commit(tmp: Path, final: Path, index: dict, files: list[str], timeout: float = 300.0) -> None:
    """Rank 0, once every rank's file is in `tmp` (each renamed there whole): the index, then
    the directory renamed to its checkpoint name (atomic: POSIX rename(2)) and the oldest
    pruned. Until the rename the previous checkpoint is the newest."""
    deadline = time.monotonic() + timeout
    while not all((tmp / f).exists() for f in files):
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {final.name}: not every rank's file arrived")
        time.sleep(0.01)
    (tmp / INDEX).write_text(json.dumps(index))
    with open(tmp / INDEX, "rb+") as f:
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    for m in sorted(filter(None, map(_NAME.match, os.listdir(final.parent))),
                    key=lambda m: int(m.group(1)))[:-KEEP]:
        shutil.rmtree(final.parent / m.group(0), ignore_errors=True)


_pending: list = []    # this rank's save in flight: [thread, error box]


def wait() -> None:
    """Block until this rank's save in flight (if any) is on disk; re-raise its error."""
    while _pending:
        thread, error = _pending.pop()
        thread.join()
        if error:
            raise error[0]


def _write(pieces, tmp, rank, final, index, world_size, error) -> None:
    try:
        write_file_atomically(pieces, tmp / rank_file(rank))
        if index is not None:
            commit(tmp, final, index, [rank_file(r) for r in range(world_size)])
    except BaseException as e:     # raised at the next wait(), on the training thread
        error.append(e)


def save(strategy, step: int, losses: list[float], directory, blocking: bool = False) -> Path:
    """Every rank writes the pieces it is chosen for (sharded_checkpoint.dedupe) to its own file in a temporary
    directory; rank 0 writes the index and renames the directory. Collective (one exchange of
    names and boxes: no tensor travels)."""
    ctx = strategy.ctx
    wait()                      # the previous save first: one in flight at a time
    if through_dcp(type(strategy)):
        return _save_dcp(strategy, step, losses, directory)
    pieces, tensors = dedupe(rank_pieces(strategy), ctx.rank)
    if ctx.device.type == "cuda":
        # copies on the host (pinned: the device-to-host copy is a DMA), written in the
        # background while training changes the parameters on the device
        pieces = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
                  for k, t in pieces.items()}
    else:
        # On the CPU the copy would sit beside what it copies, in the same memory (issue 52: the
        # rank's weights, m and v, 3/4 of its states, held twice): the rank's own tensors are
        # written instead, before training changes them
        blocking = True
    if ctx.rank == 0:
        pieces.update(_rng_state(ctx.device))
    final = checkpoint_path(directory, step)
    tmp = _temporary(directory, final)
    index = None
    if ctx.rank == 0:
        index = {"format": FORMAT, "step": step, "losses": list(losses),
                 "optimizer_step": _optimizer_step(strategy), "world_size": ctx.world_size,
                 "run": run_identity(ctx.cfg), "tensors": tensors}
    # the disk is the background thread's: the next step does not wait for it (asynchronous
    # save; torch.distributed.checkpoint.async_save does the same with a thread or a process)
    error: list = []
    thread = threading.Thread(target=_write, args=(pieces, tmp, ctx.rank, final, index,
                                                   ctx.world_size, error), daemon=True)
    thread.start()
    _pending.append((thread, error))
    if blocking:
        wait()
    return final


def _temporary(directory, final: Path) -> Path:
    """A hidden directory beside `final`, one name for every rank (rank 0's token)."""
    token = [f"{os.getpid()}-{time.time_ns()}"]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    tmp = Path(directory) / f".{final.name}.tmp-{token[0]}"
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def _save_dcp(strategy, step: int, losses: list[float], directory) -> Path:
    """A twin's checkpoint: DCP's files into the temporary directory (every rank's are written
    when dcp.save returns: it ends with rank 0 writing the metadata after every rank reported),
    then the same index and rename as ours. Blocking: dcp.async_save would be the twin of our
    background thread."""
    ctx = strategy.ctx
    final = checkpoint_path(directory, step)
    tmp = _temporary(directory, final)
    dcp_checkpoint.save_state(strategy, tmp)
    if ctx.rank == 0:
        commit(tmp, final, {"format": dcp_checkpoint.FORMAT, "step": step, "losses": list(losses),
                            "world_size": ctx.world_size, "run": run_identity(ctx.cfg)}, [])
    if dist.is_initialized():    # the next save (or a reader) sees this one renamed
        dist.barrier()
    return final


def _optimizer_step(strategy) -> int:
    for opt, master, *_ in _holders(strategy):
        return int(opt.state[master]["step"])
    return 0


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
    # read lazily: each rank reads only the boxes it places (refimpl.lab.checkpoint.sharded_checkpoint)
    ck = ShardedCheckpoint(path)
    if ck.index["format"] == dcp_checkpoint.FORMAT:   # a twin's: DCP loads it into the placed model
        return {"format": dcp_checkpoint.FORMAT, "step": ck.index["step"],
                "losses": ck.index["losses"], "path": path}
    with ck.file(rank_file(0)) as first:
        rng = {kind: first.get_tensor(f"rng/{kind}").clone() for kind in ("cpu", "cuda")
               if f"rng/{kind}" in first.keys()}
    return {"step": ck.index["step"], "losses": ck.index["losses"], "weights": ck.tensors("weights"),
            "optimizer": {"step": ck.index["optimizer_step"], "exp_avg": ck.tensors("exp_avg"),
                          "exp_avg_sq": ck.tensors("exp_avg_sq")},
            "rng": rng, "path": path}


def restore(strategy, saved: dict) -> None:
    """AdamW's state and the generator, after the strategy placed the checkpoint's weights (a
    twin's: the weights too, read by DCP into the tensors it placed)."""
    if saved.get("format") == dcp_checkpoint.FORMAT:
        dcp_checkpoint.load_state(strategy, saved["path"])
        return
    load_optimizer_state(strategy, saved["optimizer"])
    torch.set_rng_state(saved["rng"]["cpu"])
    if "cuda" in saved["rng"] and strategy.ctx.device.type == "cuda":
        torch.cuda.set_rng_state(saved["rng"]["cuda"], strategy.ctx.device)
