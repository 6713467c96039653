"""Experts composed with tensor parallelism and with every data-parallel flavour, equal to `single`.

tp x experts: each expert's MLP split over tp (refimpl.parallel.tp.experts), with and without
sequence parallelism, alone (ep = 1) and with the experts spread over ep as well. dp flavours:
dp-naive, dp, zero1, zero2, zero3 and fsdp on a MoE model with --ep 2 over dp = 4, where the
dense parameters are synced (or sharded) over dp x cp and the experts over edp. Float64 and the
1e-9 gate on losses and final weights (refimpl.lab.verify.equivalence), with a capacity tight enough
to drop tokens (so the global capacity and the aux loss's f_i must count each token once) and the
aux loss on. One launch per world size runs every case of that size. And AdamW's moments of
experts sharded over edp gather to single's and, saved, resume under another layout.
"""
import functools
from dataclasses import replace

import pytest
import torch

from refimpl.config import TrainConfig
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.measure.ep_load import dropped_by_step
from refimpl.lab.verify.equivalence import (
    FP64_TOLERANCE,
    compare_states,
    compare_with_single,
    reference_run,
)
from refimpl.lab.verify.reshard import save_checkpoint
from refimpl.model import GPTConfig
from refimpl.train import train_on_ranks

pytestmark = pytest.mark.ranks

# 2 blocks, 4 heads (tp 2 divides heads, MLP width 128 and vocabulary 96), 4 experts (ep 2).
MODEL = GPTConfig(vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4,
                  top_k=2, capacity_factor=1.0)   # top-2 at C = k·T/E: some tokens overflow


def config(strategy: str, nproc: int, **layout) -> TrainConfig:
    return LabConfig(strategy=strategy, nproc=nproc, steps=2, global_batch=8, seq_len=16,
                     model=MODEL, return_state=True, dtype="float64", **layout)


# make test runs the first launch (4 ranks): experts split over tp and spread over ep under
# sequence parallelism and fsdp, and both other gradient paths over edp (zero2's streamed
# partitions, dp's bucket sets); the rest are `full`.
QUICK = {"fsdp-tp2-ep2-sp": config("fsdp", 4, tp=2, ep=2, sequence_parallel=True),
         # its weights and moments are the checkpoint of the resharding test below
         "zero2-ep2": config("zero2", 4, ep=2, options={"bucket_mb": 0.01},
                             return_optimizer_state=True),
         "dp-ep2": config("dp", 4, ep=2, options={"bucket_mb": 0.01})}
FULL = {2: {"tp2": config("tp", 2),
            "tp2-sp": config("tp", 2, sequence_parallel=True)},
        4: {"tp2-ep2": config("dp-naive", 4, tp=2, ep=2),
            "tp2-ep2-sp": config("dp-naive", 4, tp=2, ep=2, sequence_parallel=True),
            "tp2-dp2-zero1": config("zero1", 4, tp=2),
            "zero3-dp4-ep1": config("zero3", 4),        # every expert in its block's one unit
            "dp-naive-ep2": config("dp-naive", 4, ep=2),
            "zero1-ep2": config("zero1", 4, ep=2, options={"bucket_mb": 0.01}),
            "zero2-ep2-no-overlap": config("zero2", 4, ep=2, options={"overlap": False}),
            "zero3-ep2": config("zero3", 4, ep=2),
            "fsdp-ep2": config("fsdp", 4, ep=2),
            "fsdp-tp2-ep2": config("fsdp", 4, tp=2, ep=2)}}


@functools.lru_cache(maxsize=None)
def runs(key) -> dict:
    cfgs = QUICK if key == "quick" else FULL[key]
    return dict(zip(cfgs, train_several_on_ranks(list(cfgs.values()))))


def check(cfg: TrainConfig, result: dict) -> None:
    eq = compare_with_single(cfg, result)
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, eq
    # the same tokens overflow as in single: capacity counted over the batch once, not t times
    assert dropped_by_step(result) == dropped_by_step(reference_run(cfg))


def test_reference_drops_tokens():
    assert min(dropped_by_step(reference_run(QUICK["dp-ep2"]))) > 0


@pytest.mark.parametrize("name", list(QUICK))
def test_experts_with_tp_and_sharded_dp_match_single(name):
    check(QUICK[name], runs("quick")[name])


@pytest.mark.full
@pytest.mark.parametrize("world,name", [(w, n) for w in FULL for n in FULL[w]])
def test_every_pairing_matches_single(world, name):
    check(FULL[world][name], runs(world)[name])


@pytest.mark.full
def test_expert_moments_saved_under_zero2_ep_resume_under_fsdp_tp_ep(tmp_path):
    """AdamW's m and v of experts sharded over edp gather to single's; placed by another layout
    (fsdp, tp2 x ep2) training goes on as single's does from the same state, and not as a
    continuation whose moments restart from zero (so the moments arrived)."""
    written = runs("quick")["zero2-ep2"]
    single = train_on_ranks(config("single", 1, return_optimizer_state=True))["optimizer_state"]
    for m in ("exp_avg", "exp_avg_sq"):
        assert compare_states(written["optimizer_state"][m], single[m])[0] < FP64_TOLERANCE
    save_checkpoint(written["state_dict"], tmp_path / "weights.pt")
    torch.save(written["optimizer_state"], tmp_path / "adamw.pt")
    resumed = config("fsdp", 4, tp=2, ep=2, init_state=str(tmp_path / "weights.pt"),
                     init_optimizer_state=str(tmp_path / "adamw.pt"))
    runs_ = [resumed, resumed.with_(init_optimizer_state=None)]
    eq, restarted = (compare_with_single(c, r) for c, r in zip(runs_, train_several_on_ranks(runs_)))
    assert eq.ok and restarted.ok, (eq, restarted)
    assert abs(restarted.losses[1] - eq.losses[1]) > 1e-6


@pytest.mark.parametrize("strategy,layout,words", [
    ("torch-ddp", dict(ep=2), "would sum different experts"),
    ("torch-fsdp2", dict(ep=2), "would sum different experts"),
    ("torch-tp", dict(tp=4), "names no MoE layer")])
def test_twins_refuse_expert_layouts_before_launch(strategy, layout, words):
    from refimpl.mesh import LayoutError
    from refimpl.train import validate

    with pytest.raises(LayoutError, match=words):
        validate(replace(config(strategy, 4, **layout), return_state=False))
