"""PyTorch's twins checkpoint the way PyTorch does: torch.distributed.checkpoint (DCP).

Our strategies write refimpl's sharded format (refimpl.lab.checkpoint.sharded_checkpoint: a box of the
reference's tensor per piece). The twins' parameters are PyTorch's own -- DDP's replicas, FSDP2's
and parallelize_module's DTensors -- and PyTorch has the twin of that format: DCP, whose metadata
records each tensor's chunks (offsets, lengths: our boxes) and whose load reads the chunks a rank's
DTensor needs, so a checkpoint written on 2 ranks loads on 3, or under another twin.

    model_sd, optim_sd = get_state_dict(model, optimizer)   # canonical names, DTensors kept
    dcp.save({"model": model_sd, "optim": optim_sd, "rng": ...}, checkpoint_id=directory)
    dcp.load(state, checkpoint_id=directory)                # in place, into this layout's tensors
    set_state_dict(model, optimizer, model_state_dict=..., optim_state_dict=...)

`get_state_dict` names the optimizer's state by parameter name instead of by id (an AdamW's m, v
and step per parameter, each a DTensor like its parameter). The directory, its atomic rename, the
index with the step and the losses, and which checkpoint a run resumes from are
refimpl.lab.checkpoint.run_checkpoint's, shared with our format; this module is the state it holds.

Which twins: those whose every sharded tensor is a DTensor (or a replica): torch-ddp, torch-fsdp2
(and -gradop), torch-tp, torch-fsdp2-tp, on their own axes. A twin on our transforms' shards
(torch-fsdp2 --tp 2: plain tensors, each rank's a different slice under one name) or on
pipeline stages is refused before launch (`refusal`): DCP would take two ranks' different slices
for one replicated tensor.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from refimpl.lab.twins.base import on_our_transforms, through_dcp

FORMAT = "dcp"


def refusal(cfg, strategy_cls) -> str | None:
    """None if `strategy_cls` on `cfg` checkpoints through DCP, else why not (one line)."""
    if not through_dcp(strategy_cls):
        return (f"not for {cfg.strategy!r} (its optimizer state is not resharded; --save-state / "
                "--init-state carry the weights)")
    dims = cfg.dims
    ours = {"pp": dims.pp, "cp": dims.cp, "ep": cfg.ep}
    if on_our_transforms(strategy_cls):           # our tp slices are plain tensors, not DTensors
        ours["tp"] = dims.tp
    beside = [f"--{axis} {n}" for axis, n in ours.items() if n > 1]
    if beside:
        return (f"{cfg.strategy!r} checkpoints through torch.distributed.checkpoint, which needs "
                f"every sharded tensor a DTensor: not with {', '.join(beside)}")
    return None


def _state(strategy) -> dict:
    """What a twin's checkpoint holds, as DCP saves and loads it: the model's and the optimizer's
    state dicts under the reference's names, and the generator (replicated: every rank seeds the
    same way, so rank 0's copy is written)."""
    model_sd, optim_sd = get_state_dict(strategy.model, strategy.optimizer)
    return {"model": model_sd, "optim": optim_sd, "rng": torch.get_rng_state()}


def save_state(strategy, directory) -> None:
    """Every rank writes its chunks into `directory`; collective (DCP plans the writes on rank 0
    and writes the metadata there once every rank's files are written)."""
    dcp.save(_state(strategy), checkpoint_id=str(directory))


def load_state(strategy, directory) -> None:
    """Every rank reads the chunks its tensors need (any world size, any of the twins above),
    in place; then the optimizer gets its state back by parameter. Collective."""
    # get_state_dict gives AdamW a state to load into: one step with zero gradients at lr 0
    # (torch's _init_optim_state), which moves no weight
    state = _state(strategy)
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(strategy.model, strategy.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"])
