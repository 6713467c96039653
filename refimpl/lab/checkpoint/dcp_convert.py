"""refimpl's sharded checkpoint converted to torch.distributed.checkpoint's, for PyTorch's twins.

    step = convert_to_dcp("ckpt/step-00000010", "twin-ckpt")   # -> twin-ckpt/step-00000010
    python -m refimpl train --strategy torch-fsdp2 --checkpoint-dir twin-ckpt ...   # resumes

Why a conversion rather than one format: ours records each piece as a box of the reference's
tensor, read by our placements (refimpl.lab.checkpoint.sharded_checkpoint); DCP records chunks of
DTensors and loads through get_state_dict/set_state_dict (refimpl.lab.checkpoint.dcp_checkpoint). The
two say the same thing -- every tensor's global shape and where its parts are -- so the converter
is a one-process twin: it builds the reference model and AdamW as a twin would, takes
get_state_dict's state dict as the template (the names, the optimizer's param_groups), fills
every tensor from our checkpoint (weights, m, v, the step count, the generator) and saves it
with dcp.save. DCP then reshards it onto any twin's layout when it loads.

It holds the whole model and its moments in one process (an offline tool: 3x the weights' bytes);
a rank of the run itself never does.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from refimpl.config import TrainConfig
from refimpl.lab.checkpoint import dcp_checkpoint
from refimpl.lab.checkpoint.optim_reshard import MOMENTS
from refimpl.lab.checkpoint.run_checkpoint import FORMAT, RUN_KEYS, checkpoint_path, commit
from refimpl.lab.checkpoint.sharded_checkpoint import ShardedCheckpoint, rank_file
from refimpl.model import GPTConfig, build_model, converted
from refimpl.strategy import make_optimizer


def convert_to_dcp(source, directory) -> Path:
    """Our checkpoint `source` (a step-NNNNNNNN directory) as a twin's checkpoint of the same
    step in `directory`; returns its path. One process, no process group."""
    ours = ShardedCheckpoint(source)
    index = ours.index
    if index.get("format") != FORMAT:
        raise ValueError(f"{source}: format {index.get('format')!r}, not refimpl's {FORMAT!r}")
    run = index["run"]
    cfg = TrainConfig(model=GPTConfig(**run["model"]), **{k: run[k] for k in RUN_KEYS})
    dtype = getattr(torch, cfg.dtype)
    model = converted(build_model(cfg.model, cfg.seed), dtype=dtype)
    optimizer = make_optimizer(model.parameters(), cfg)
    model_sd, optim_sd = get_state_dict(model, optimizer)   # AdamW's state made (lr 0, no move)
    weights, moments = ours.tensors("weights"), {m: ours.tensors(m) for m in MOMENTS}
    for name, t in model_sd.items():
        t.copy_(weights[name])
    for name, state in optim_sd["state"].items():
        state["step"].fill_(float(index["optimizer_step"]))
        for m, saved in moments.items():
            state[m].copy_(saved[name])
    rng = ours.file(rank_file(0)).get_tensor("rng/cpu")
    # written as a run writes one: a hidden directory, renamed whole once the index is in it
    final = checkpoint_path(directory, index["step"])
    tmp = Path(directory) / f".{final.name}.tmp-convert-{os.getpid()}"
    tmp.mkdir(parents=True)
    dcp.save({"model": model_sd, "optim": optim_sd, "rng": rng}, checkpoint_id=str(tmp),
             no_dist=True)
    commit(tmp, final, {"format": dcp_checkpoint.FORMAT,
                        **{k: index[k] for k in ("step", "losses", "world_size", "run")}}, [])
    return final
