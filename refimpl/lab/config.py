"""What the lab adds to a run's configuration: what to record, save, load or break. A `LabConfig` is a
TrainConfig with the lab's knobs (the CLI builds one); the lab reads a run's through `lab_config`,
which gives a plain TrainConfig the defaults: nothing recorded, saved, loaded or broken.

    train_on_ranks(LabConfig(strategy="tp", nproc=2, profile=True))     # a trace in profiles/cli/
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from refimpl.config import TrainConfig


@dataclass(frozen=True)
class LabConfig(TrainConfig):
    profile: bool = False
    trace_dir: str | None = None      # where --profile writes; default profiles/cli/<strategy>-<n>
    record_memory: bool = False       # measure each rank's peak inside a step (memory[r].peak)
    return_state: bool = False        # include the full state dict in each rank's result
    init_state: str | None = None     # torch.save'd full state dict to start from (any strategy's)
    init_hf: str | None = None        # a Hugging Face checkpoint folder to start from (checkpoint.hf)
    init_optimizer_state: str | None = None   # AdamW's m, v, step in reference names (optim_reshard)
    return_optimizer_state: bool = False      # include them, gathered, in rank 0's result
    save_state: str | None = None     # the full state, written by rank 0 (checkpoint.export)
    save_optimizer_state: str | None = None
    checkpoint_every: int = 0         # save every K steps; a run resumes from the last (run_checkpoint)
    checkpoint_dir: str | None = None
    fault: str | None = None          # a bug on purpose (refimpl.lab.faults, a variant plug-in)


def lab_config(cfg: TrainConfig) -> LabConfig:
    """`cfg` as the lab reads it: itself if it is a LabConfig, else with the lab's defaults."""
    if isinstance(cfg, LabConfig):
        return cfg
    return LabConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})
