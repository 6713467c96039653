"""The data-parallel runs the tests assert on, one launch per world size (start-up is ~3 s each).

Every configuration of a world size runs in the same ranks, one after the other
(refimpl.lab.loop.train_several_on_ranks); results are cached for the session, so test_dp.py and
test_zero12.py share them.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

from refimpl.config import TrainConfig
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single, ranks_device, reference_run
from refimpl.train import train_on_ranks
from tests.models import SMALL

STEPS = 3
# The equivalence runs are float64 (refimpl.lab.verify.equivalence: a 1e-9 gate that no processor's
# BLAS can move); the bf16 runs keep fp32 master weights. Bytes per element of each:
ELEMENT = {"float64": 8, "float32": 4}
SMALL_BUCKETS = {"bucket_mb": 0.25}          # several buckets on SMALL's 1.7 MB of float64
WORK = Path(tempfile.mkdtemp(prefix="refimpl-dp-tests-"))   # traces and the checkpoint
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


# Which runs each test file reads: test_dp.py the replicating flavours, test_zero12.py the ZeRO
# stages and the dp runs they are compared with. Each file launches only its own (the two files
# usually land on different pytest-xdist workers, whose caches are their own).
FAMILIES = {"dp": lambda name: not name.startswith(("zero", "torch-zero", "dp-from")),
            "zero": lambda name: name.startswith(("zero", "torch-zero")) or name in
            ("dp", "dp-from-zero2-checkpoint")}


def base(world: int, strategy: str, **changes) -> TrainConfig:
    return LabConfig(strategy=strategy, nproc=world, steps=STEPS, dtype="float64", model=SMALL,
                     global_batch=12 if world == 3 else 8, return_state=True).with_(**changes)


def configs(world: int, family: str) -> dict[str, TrainConfig]:
    runs = {
        "dp-naive": base(world, "dp-naive"),
        "dp": base(world, "dp", options=SMALL_BUCKETS),
        "dp-micro2": base(world, "dp", options=SMALL_BUCKETS, micro_batches=2),
        "torch-ddp": base(world, "torch-ddp"),
        "zero1": base(world, "zero1", options=SMALL_BUCKETS),
        "zero2": base(world, "zero2", options=SMALL_BUCKETS),
        "torch-zero1": base(world, "torch-zero1"),
    }
    if world == 2:
        runs.update({
            "dp-profiled": base(2, "dp", options=SMALL_BUCKETS, profile=True,
                                trace_dir=str(WORK / "dp-trace")),
            "torch-ddp-micro2": base(2, "torch-ddp", micro_batches=2),
            "zero1-flat": base(2, "zero1", options={"overlap": False}),
            "zero2-flat": base(2, "zero2", options={"overlap": False}),
            "zero1-offload": base(2, "zero1", options={"offload": True}),
            "zero2-offload": base(2, "zero2", options={**SMALL_BUCKETS, "offload": True}),
            "dp-bf16": base(2, "dp", mixed_precision="bf16", dtype="float32"),
            "zero2-bf16": base(2, "zero2", mixed_precision="bf16", dtype="float32"),
            "dp-checkpointing": base(2, "dp", activation_checkpointing=True),
            "zero2-checkpointing": base(2, "zero2", activation_checkpointing=True),
            # two backwards per step: each adds into the gradient (shard), none overwrites it
            "zero1-micro2": base(2, "zero1", options=SMALL_BUCKETS, micro_batches=2),
            "zero2-micro2": base(2, "zero2", options=SMALL_BUCKETS, micro_batches=2),
        })
    if world == 3 and family == "zero":
        # Resharding: the full state zero2 wrote on 2 ranks starts a dp run on 3.
        runs["dp-from-zero2-checkpoint"] = base(3, "dp", init_state=zero2_checkpoint())
    return {name: cfg for name, cfg in runs.items() if FAMILIES[family](name)}


@functools.cache
def runs_on(world: int, family: str) -> dict[str, dict]:
    cfgs = configs(world, family)
    results = train_several_on_ranks(list(cfgs.values()), timeout=600)
    return {name: (cfgs[name], result) for name, result in zip(cfgs, results)}


@functools.cache
def zero2_checkpoint() -> str:
    path = WORK / "zero2-2ranks.pt"
    torch.save(runs_on(2, "zero")["zero2"][1]["state_dict"], path)
    return str(path)


def assert_matches_single(cfg: TrainConfig, result: dict) -> None:
    """Same losses and same final weights as `single` (float64: relative error <= 1e-9, the weights
    as one vector; refimpl.lab.verify.equivalence explains the gate)."""
    reference(cfg)                           # cached on one thread; compare_with_single reuses it
    eq = compare_with_single(cfg, result)
    assert cfg.dtype == "float64" and eq.tolerance == FP64_TOLERANCE
    assert eq.loss_rel_err <= FP64_TOLERANCE, (cfg.strategy, cfg.nproc, eq.losses,
                                               eq.reference_losses)
    assert eq.weight_rel_err <= FP64_TOLERANCE, (cfg.strategy, cfg.nproc, eq.weight_rel_err)


def reference(cfg: TrainConfig) -> dict:
    """refimpl.lab.verify.equivalence.reference_run (cached; in-process runs use one thread, as ranks do)."""
    return reference_run(cfg)


def single_accumulating(world: int, global_batch: int) -> dict:
    """`single` with one micro-batch per rank's rows, in one thread like a rank: each micro-step's
    gradient is computed with exactly the arithmetic a data-parallel rank uses, and with 2 ranks
    the sum of two halves is the same in any order -- so DP must be bit-exact with it."""
    return train_on_ranks(LabConfig(steps=STEPS, global_batch=global_batch, dtype="float64", model=SMALL,
                                    micro_batches=world, return_state=True,
                                    device=ranks_device(world)))
