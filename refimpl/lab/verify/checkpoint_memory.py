"""What a rank holds while it saves and loads a sharded checkpoint: its shard plus one tensor.

A checkpoint gathered whole (torch.save of the full state dict) puts the whole model, and AdamW's
m and v, on one rank: at 70B, 840 GB in fp32. The sharded format (refimpl.lab.checkpoint.sharded_checkpoint)
is built so that no rank ever does: a rank writes the pieces it holds (on a GPU, from host
copies), and a rank resuming under any layout reads, one tensor at a time, the parts it places.
This measures it:

    found = measure(write_cfg, read_cfg, directory)   # one launch, per rank:
    found[r]["save_peak"]    tensor bytes allocated at the worst moment of a save, beyond what
                             the rank held before it (on the CPU none to speak of: it writes
                             its own tensors)
    found[r]["written"]      the bytes of the rank's file (weights, m, v it is the first holder of)
    found[r]["load_peak"]    bytes alive at the worst moment of placing the checkpoint under
                             read_cfg's layout (weights, m and v, buffers), and
    found[r]["kept"]         what is still alive once it is placed: the rank's shard of the state

Bytes are refimpl.lab.measure.live_memory.LiveBytes': every storage a torch op makes, as requested, until
freed (meta tensors, the reference's shapes, are not bytes). The slice safetensors reads from
the file before it is copied into place is made outside torch's ops and not counted; it is at
most the box being read, never more than the tensor.
"""
from __future__ import annotations

import functools
import gc

from safetensors import safe_open

from refimpl import launch
from refimpl.config import TrainConfig
from refimpl.lab.checkpoint import run_checkpoint, sharded_checkpoint
from refimpl.lab.config import lab_config
from refimpl.lab.loop import setup_rank
from refimpl.lab.measure.live_memory import LiveBytes
from refimpl.lab.rank_build.shard_only import place_shards
from refimpl.model import synthetic_batch
from refimpl.registry import resolve
from refimpl.train import setup_rank as setup_rank_with
from refimpl.train import validate


def _file_bytes(path) -> int:
    f = safe_open(str(path), "pt")
    return sum(f.get_tensor(k).nbytes for k in f.keys() if not k.startswith("rng/"))


def _measure_rank(rank: int, world_size: int, write_cfg: TrainConfig, read_cfg: TrainConfig,
                  directory: str) -> dict:
    layout = resolve(write_cfg)
    _, strategy, _ = setup_rank(rank, world_size, layout)
    cfg = layout.cfg
    batch = synthetic_batch(cfg.model, cfg.global_batch, cfg.seq_len, cfg.seed, 0)
    loss = strategy.train_step(batch)          # AdamW's m, v exist from here
    with LiveBytes(count_meta=False) as saving:
        path = run_checkpoint.save(strategy, 1, [float(loss)], directory, blocking=True)
    del strategy
    gc.collect()
    resume = run_checkpoint.load_latest(directory)
    with LiveBytes(count_meta=False) as loading:
        weights = functools.partial(place_shards, initial=lambda reference: resume.get("weights"))
        _, strategy, _ = setup_rank_with(rank, world_size, resolve(read_cfg), weights)
        run_checkpoint.restore(strategy, resume)
    return {"save_peak": saving.peak, "written": _file_bytes(path / sharded_checkpoint.rank_file(rank)),
            "load_peak": loading.peak, "kept": loading.current}


def measure(write_cfg: TrainConfig, read_cfg: TrainConfig, directory, timeout: float = 600.0
            ) -> list[dict]:
    """Per rank: one step and a save under `write_cfg`, then the checkpoint placed under
    `read_cfg` (the same world size), measured as the module docstring says. One launch."""
    if write_cfg.nproc != read_cfg.nproc:
        raise ValueError("measure: the writer and the reader run in one launch (one world size)")
    validate(write_cfg)
    validate(lab_config(read_cfg).with_(checkpoint_dir=None))
    return launch.run(_measure_rank, write_cfg.nproc, write_cfg, read_cfg, str(directory),
                      timeout=timeout)
