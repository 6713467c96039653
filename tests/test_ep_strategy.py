"""`--strategy ep` through the one loop: the same losses, weights and dropped tokens as `single`
with the same experts, on 2 and 4 ranks, and with ep smaller than the data-parallel group."""
import functools

import pytest

from refimpl.config import TrainConfig
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.measure.ep_load import all_to_all_frame, dropped_by_step, expert_frame, rank_frame
from refimpl.lab.predict.strategy_cost import ep_buffer_bytes
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single, reference_run
from refimpl.model import GPTConfig
from refimpl.registry import resolve

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

MODEL = GPTConfig(vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4)
LOOSE = dict(top_k=2, capacity_factor=4.0)                                  # nothing dropped
TIGHT = dict(top_k=1, capacity_factor=0.5, balance="bias", bias_gamma=0.01)  # half dropped


def config(nproc: int, ep: int = 1, **moe) -> TrainConfig:
    from dataclasses import replace

    return LabConfig(strategy="ep", nproc=nproc, ep=ep, steps=3, global_batch=8, seq_len=16,
                     model=replace(MODEL, **moe), return_state=True, dtype="float64")


CASES = {2: {"loose": config(2, **LOOSE), "tight": config(2, **TIGHT),
             "refimpl-collectives": config(2, **LOOSE).with_(collectives="refimpl"),
             "tight-checkpointing": config(2, **TIGHT).with_(activation_checkpointing=True),
             # Micro-batches: capacity and f_i are per micro-batch, whose tokens differ between
             # layouts; with nothing dropped and no aux loss the maths is the same (ep.py).
             "micro2-loose-none": config(2, **LOOSE, balance="none").with_(micro_batches=2),
             # Plain data parallelism on the MoE: every replica holds every expert; the routing
             # counts are shared so capacity and the aux loss are global too.
             "dp-tight": config(2, **TIGHT).with_(strategy="dp"),
             "dp-naive-loose": config(2, **LOOSE).with_(strategy="dp-naive")},
         3: {"six-experts": config(3, **LOOSE, n_experts=6).with_(global_batch=6)},
         4: {"loose": config(4, **LOOSE), "tight": config(4, **TIGHT),
             "ep2-loose": config(4, ep=2, **LOOSE), "ep2-tight": config(4, ep=2, **TIGHT)}}


@functools.lru_cache(maxsize=None)
def runs_on(world: int) -> dict:
    cfgs = CASES[world]
    return dict(zip(cfgs, train_several_on_ranks(list(cfgs.values()))))


@pytest.mark.parametrize("world,name", [(w, n) for w in CASES for n in CASES[w]])
def test_ep_matches_single_with_the_same_experts(world, name):
    cfg = CASES[world][name]
    eq = compare_with_single(cfg, runs_on(world)[name])
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, eq


@pytest.mark.parametrize("world,name", [(2, "tight"), (4, "tight"), (4, "ep2-tight")])
def test_tight_capacity_drops_as_many_tokens_per_expert_as_single(world, name):
    result, ref = runs_on(world)[name], reference_run(CASES[world][name])
    assert dropped_by_step(result) == dropped_by_step(ref)
    assert min(dropped_by_step(ref)) > 0
    assert expert_frame(result).equals(expert_frame(ref))


@pytest.mark.parametrize("world,name", [(2, "loose"), (4, "loose"), (4, "ep2-loose")])
def test_each_rank_processes_the_tokens_routed_to_its_experts(world, name):
    result = runs_on(world)[name]
    ep = resolve(CASES[world][name]).cfg.dims.ep      # the shorthand: ep = dp x cp
    by_rank = rank_frame(result)
    routed = expert_frame(result)
    # Summed over the ranks that hold expert e (one per ep chunk), received = routed (no drops).
    got = by_rank.groupby(["step", "layer", "expert"]).received.sum().reset_index()
    assert got.received.tolist() == routed.routed.tolist()
    # Each rank holds E/ep experts: the ones it received rows for.
    assert by_rank.groupby("rank").expert.nunique().eq(MODEL.n_experts // ep).all()


@pytest.mark.parametrize("world,name", [(2, "loose"), (4, "loose"), (4, "ep2-loose")])
def test_all_to_all_bytes_on_the_wire_are_whole_buffers_holding_the_rows_that_crossed_ranks(world, name):
    traffic = all_to_all_frame(runs_on(world)[name], MODEL.d_model, bytes_per_value=8)  # float64
    assert len(traffic) == world * CASES[world][name].steps
    # the wire carries the whole [E, B] buffers, predicted from the shapes alone; the routed rows
    # (from the routing records) are a part of them, the rest padding
    cfg = CASES[world][name]
    tokens = cfg.global_batch * cfg.seq_len
    want = ep_buffer_bytes(tokens // world, world, MODEL.n_experts, LOOSE["top_k"],
                           LOOSE["capacity_factor"], MODEL.d_model, MODEL.n_layers,
                           resolve(cfg).cfg.dims.ep, bytes_per_value=8)["sent_per_rank"]
    assert (traffic.sent_bytes == want).all()
    assert (traffic.routed_bytes > 0).all() and (traffic.padding_bytes > 0).all()


@pytest.mark.parametrize("args,words", [
    (["--strategy", "ep", "--nproc", "4", "--experts", "6", "--global-batch", "8"],
     "divisible by ep"),
    (["--strategy", "single", "--experts", "4", "--top-k", "5"], "--top-k"),
    (["--strategy", "single", "--experts", "4", "--capacity-factor", "0"], "--capacity-factor"),
    (["--strategy", "torch-ddp", "--nproc", "4", "--ep", "2", "--experts", "4"],
     "would sum different experts"),
    (["--strategy", "single", "--experts", "4", "--set", "balance=both"], "balance"),
])
def test_bad_moe_layouts_exit_2_with_one_line_before_launch(args, words, capsys):
    # In process: main returns 2 before any rank starts (tests/test_cli.py shows that exit code
    # reaching the shell once, for every flag: a subprocess per layout only re-imported torch).
    from refimpl.lab.cli import main

    assert main(["train", *args, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err
