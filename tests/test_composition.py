"""Composing the axes through the one loop: named pairings equal `single` (losses and final weights
after 3 AdamW steps) -- dp x tp, dp x pp, tp x pp, pp x cp on 4 ranks with several DP flavours on
the dp axis, sequence parallelism and activation checkpointing among them, and dp2 x tp2 x pp2 on
8 ranks (every pairing: the layout matrix, tests/test_layout_matrix.py); a checkpoint (weights and AdamW's m, v) written under one layout is placed exactly by
another and training goes on as `single`'s does from the same state; PyTorch's composed twin
(torch-fsdp2-tp: FSDP2 + DTensor TP, and with --pp torch.distributed.pipelining) matches ours;
what does not compose fails before launch.
"""
import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from refimpl.config import TrainConfig
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.measure import moe_collectives
from refimpl.lab.trace.profiling import load_trace
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single
from refimpl.lab.verify.reshard import placed_state, save_checkpoint
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig
from refimpl.registry import resolve
from refimpl.train import train_on_ranks, validate
from tests.models import SMALL

TWO_BLOCKS = GPTConfig(**{**SMALL.to_dict(), "n_layers": 2})
# 4 experts, top-2, capacity binding (some tokens overflow every step), counted per sequence: the
# rule that equals single when a forward holds other tokens than single's (refimpl.model.moe)
EXPERTS = dict(n_experts=4, top_k=2, capacity_factor=0.75, capacity_scope="sequence")


def moe(config: TrainConfig, **balance) -> TrainConfig:
    """The layout on a 2-block MoE model, 2 steps."""
    return config.with_(steps=2, model=GPTConfig(**{**TWO_BLOCKS.to_dict(), **EXPERTS, **balance}))

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)
WORK = Path(tempfile.mkdtemp(prefix="refimpl-composition-"))   # the MoE layout's trace
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


def layout(strategy, world, **kw):
    kw.setdefault("micro_batches", 2)
    kw.setdefault("dtype", "float64")     # the equivalence gate (refimpl.lab.verify.equivalence)
    return LabConfig(strategy=strategy, nproc=world, steps=3, global_batch=8, return_state=True,
                     model=SMALL, **kw)


# The layouts the other tests here read (memory shares, PyTorch's twin, the traced MoE run, the
# checkpoint) run in make test; each is also checked equal to single. The rest of the old
# hand-picked list is make test-full's: the layout matrix (tests/test_layout_matrix.py) covers
# every pairing of the axes, flavours and options on 2, 3, 4 and 8 ranks in make test.
RUNS = {
    4: {# its weights and moments are the checkpoint of the resharding test below
        "zero3 dp2 x tp2": layout("zero3", 4, tp=2, return_optimizer_state=True),
        "zero3 dp2 x pp2": layout("zero3", 4, pp=2),
        "torch-fsdp2-tp dp2 x tp2": layout("torch-fsdp2-tp", 4, tp=2, micro_batches=1),
        "fsdp dp2 x tp2": layout("fsdp", 4, tp=2, micro_batches=1)},
    "4-full": {"zero1 dp2 x tp2": layout("zero1", 4, tp=2),
               "fsdp dp2 x tp2 +sp +ckpt": layout("fsdp", 4, tp=2, sequence_parallel=True,
                                                  activation_checkpointing=True),
               "fsdp dp2 x pp2 +ckpt": layout("fsdp", 4, pp=2, activation_checkpointing=True),
               "pp-1f1b tp2 x pp2 +sp": layout("pp-1f1b", 4, tp=2, pp=2, sequence_parallel=True),
               "zero2 pp2 x cp2": layout("zero2", 4, pp=2, cp=2),
               "zero3 dp2 x pp2 interleaved v2": layout("zero3", 4, pp=2, schedule="interleaved",
                                                        virtual_stages=2, micro_batches=4),
               "zero1 dp2 x pp2 zb-h1": layout("zero1", 4, pp=2, schedule="zb-h1"),
               # tp's linears under a split schedule: W reads their own matmul (pp.zero_bubble),
               # the row-parallel bias from its slice of the sequence under SP
               "zero1 tp2 x pp2 zbv +sp": layout("zero1", 4, tp=2, pp=2, schedule="zbv",
                                                 micro_batches=4, sequence_parallel=True),
               "zero1 dp2 x pp2": layout("zero1", 4, pp=2),
               "torch-fsdp2-tp dp2 x tp2 +sp": layout("torch-fsdp2-tp", 4, tp=2, micro_batches=1,
                                                      sequence_parallel=True),
               "pp-zb tp2 x pp2": layout("pp-zb", 4, tp=2, pp=2, micro_batches=4),
               "fsdp tp2 x pp2 zb-h1 +sp": layout("fsdp", 4, tp=2, pp=2, schedule="zb-h1",
                                                  micro_batches=4, sequence_parallel=True),
               # experts on tp2 x pp2 with no ep axis (the `ep` shorthand needs >= 2 ranks left)
               "dp-naive tp2 x pp2 zb-h1, experts": moe(layout("dp-naive", 4, tp=2, pp=2,
                                                               schedule="zb-h1", micro_batches=4),
                                                        balance="aux")},
    # One 8-rank launch in make test for the 8-rank layouts the tests below read.
    8: {"fsdp dp2 x tp2 x pp2 +sp": layout("fsdp", 8, tp=2, pp=2, sequence_parallel=True),
        # a MoE model on dp x ep x tp x pp: experts split over tp, spread over ep inside dp, a
        # stage's aux loss in the step's (tests/test_moe_compose.py, tests/test_moe_tp_dp.py)
        # traced: test_moe_collectives_are_the_arithmetics counts its calls per axis
        "ep dp2 x tp2 x pp2, experts ep over dp, aux +sp": moe(layout(
            "ep", 8, tp=2, pp=2, sequence_parallel=True, profile=True,
            trace_dir=str(WORK / "moe-5d")), balance="aux")},
    "8-full": {# PyTorch's twin: FSDP2 + DTensor TP + torch.distributed.pipelining's 1F1B (2
               # blocks, 2 steps: DTensor's dispatch makes it the slowest 8-rank run; more in
               # test_torch_twin_pp.py)
               "torch-fsdp2-tp dp2 x tp2 x pp2 +sp": layout("torch-fsdp2-tp", 8, tp=2, pp=2,
                                                            sequence_parallel=True).with_(
                                                                steps=2, model=TWO_BLOCKS),
               "zero1 dp2 x tp2 x pp2": layout("zero1", 8, tp=2, pp=2),
               # ring attention over tp heads under a pipeline (refimpl.compose.tp_cp)
               "pp-1f1b cp2 x tp2 x pp2 +sp": layout("pp-1f1b", 8, tp=2, cp=2, pp=2,
                                                     sequence_parallel=True).with_(
                                                         steps=2, model=TWO_BLOCKS),
               "zero2 dp2 x cp2 x pp2": layout("zero2", 8, cp=2, pp=2),
               "fsdp grad_op dp2 x tp2 x pp2 +ckpt": layout("fsdp", 8, tp=2, pp=2,
                                                            activation_checkpointing=True,
                                                            options={"sharding": "grad_op"}),
               "dp-naive dp2 x tp2 x pp2 interleaved v2": layout("dp-naive", 8, tp=2, pp=2,
                                                                 schedule="interleaved",
                                                                 virtual_stages=2, micro_batches=4)},
}


@functools.lru_cache(maxsize=None)
def results(world):
    names = list(RUNS[world])
    return dict(zip(names, train_several_on_ranks([RUNS[world][n] for n in names], timeout=900)))


@pytest.mark.parametrize("world,name", [
    pytest.param(w, n, marks=[pytest.mark.full] if str(w).endswith("full") else [])
    for w, runs in RUNS.items() for n in runs])
def test_composed_layout_equals_single(world, name):
    config, result = RUNS[world][name], results(world)[name]
    eq = compare_with_single(config, result)
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, (eq.loss_rel_err, eq.weight_rel_err)
    assert len({tuple(r["losses"]) for r in result["per_rank"]}) == 1   # one loss on every rank


def test_moe_collectives_are_the_arithmetics():
    """The traced MoE run on dp2 x ep2 x tp2 x pp2 with sequence parallelism: every collective of a
    first-stage rank and of a last-stage rank, per axis and op, in each step, is the count of
    refimpl.lab.measure.moe_collectives (notebook 09 checks the same without SP)."""
    config = RUNS[8]["ep dp2 x tp2 x pp2, experts ep over dp, aux +sp"]
    trace = load_trace(results(8)["ep dp2 x tp2 x pp2, experts ep over dp, aux +sp"]["trace_dir"])
    for rank in (0, 7):                         # dp 0, stage 0, tp 0 and dp 1, stage 1, tp 1
        assert config.dims.coordinates(rank)["pp"] == rank // 7
        table = moe_collectives.against_trace(resolve(config).cfg, trace, rank)   # ep = dp
        steps = [c for c in table.columns if c.startswith("step")]
        assert steps and set(table.axis) == {"ep", "tp", "pp", "dp"}, table
        assert all((table[s] == table.expected).all() for s in steps), table


def test_bf16_through_a_sharded_pipeline():
    """ZeRO-3 gathers a stage's weights in bf16, so the activations between stages are bf16 too
    (the pipeline's receive buffers take the parameters' dtype): the run trains, within bf16's
    rounding of the float64 losses."""
    exact = results(4)["zero3 dp2 x pp2"]["losses"]
    bf16 = train_on_ranks(RUNS[4]["zero3 dp2 x pp2"].with_(mixed_precision="bf16", dtype="float32",
                                                            return_state=False))["losses"]
    assert max(abs(a - b) / b for a, b in zip(bf16, exact)) < 2e-2
    assert bf16 != exact


def test_composed_ranks_hold_a_share():
    """dp2 x tp2 x pp2 under fsdp: each rank holds 1/8 of the parameters (within 10%: shard
    padding, the replicated LayerNorms of tp), not the 1/4 that two of the three axes would give."""
    result = results(8)["fsdp dp2 x tp2 x pp2 +sp"]
    eighth = 8 * result["n_params"] / 8          # float64: 8 bytes a parameter
    held = [r["memory"]["params"] for r in result["per_rank"]]
    assert all(abs(h - eighth) < 0.1 * eighth for h in held), (held, eighth)


def test_pytorch_composed_twin_matches_ours():
    """FSDP2 over dp + DTensor TP over tp (one 2-D DeviceMesh) and our fsdp --tp 2: the same losses
    (both equal single above), and the same 1/(dp·tp) share of the parameters on every rank."""
    ours, theirs = results(4)["fsdp dp2 x tp2"], results(4)["torch-fsdp2-tp dp2 x tp2"]
    assert max(abs(a - b) / b for a, b in zip(ours["losses"], theirs["losses"])) < 1e-6
    quarter = 8 * ours["n_params"] / 4
    for result in (ours, theirs):
        held = [r["memory"]["params"] for r in result["per_rank"]]
        assert all(abs(h - quarter) < 0.1 * quarter for h in held), (result["strategy"], held)


@pytest.mark.full
def test_pytorch_composed_twin_with_a_pipeline_holds_an_eighth():
    """dp2 x tp2 x pp2 +sp under FSDP2 over dp, DTensor TP over tp and PyTorch's 1F1B over pp
    (torchtitan's order; equal to single above): every rank holds 1/8 of the parameters (within
    10%: FSDP2's padding, the replicated LayerNorms), as our fsdp does on the same grid."""
    theirs = results("8-full")["torch-fsdp2-tp dp2 x tp2 x pp2 +sp"]
    eighth = 8 * theirs["n_params"] / 8
    held = [r["memory"]["params"] for r in theirs["per_rank"]]
    assert all(abs(h - eighth) < 0.1 * eighth for h in held), held


def test_checkpoint_saved_under_one_layout_resumes_under_another(tmp_path):
    """Weights and AdamW's m, v and step, saved under zero3 x tp2, placed exactly by zero1 on
    pp2 x dp2; the continued run equals single continued from the same state, and differs from a
    continuation whose moments restart from zero (so the moments did arrive)."""
    from refimpl.lab.verify.equivalence import compare_states

    written = results(4)["zero3 dp2 x tp2"]            # ran with return_optimizer_state
    saved, moments = written["state_dict"], written["optimizer_state"]
    single = train_on_ranks(layout("single", 1, return_optimizer_state=True))["optimizer_state"]
    assert moments["step"] == single["step"] == 3
    for m in ("exp_avg", "exp_avg_sq"):           # gathered from zero3 x tp2 == single's own
        assert compare_states(moments[m], single[m])[0] < 1e-9
    save_checkpoint(saved, tmp_path / "weights.pt")
    torch.save(moments, tmp_path / "adamw.pt")
    resumed = layout("zero1", 4, pp=2, init_state=str(tmp_path / "weights.pt"),
                     init_optimizer_state=str(tmp_path / "adamw.pt"))
    placed = placed_state(resumed)
    assert all(torch.equal(placed["weights"][k], saved[k]) for k in saved)          # exactly
    assert all(torch.equal(placed["optimizer"][m][k], moments[m][k])
               for m in ("exp_avg", "exp_avg_sq") for k in saved)
    # One launch: resumed with the moments, resumed without them, and from scratch.
    runs = [resumed, resumed.with_(init_optimizer_state=None), layout("zero1", 4, pp=2)]
    eq, restarted, fresh = (compare_with_single(c, r)
                            for c, r in zip(runs, train_several_on_ranks(runs, timeout=900)))
    assert eq.ok, (eq.loss_rel_err, eq.weight_rel_err)
    assert restarted.ok and abs(restarted.losses[1] - eq.losses[1]) > 1e-3
    assert eq.losses[0] < fresh.losses[0] - 0.05   # it did start from the trained weights


@pytest.mark.parametrize("kw,message", [
    (dict(strategy="torch-ddp", nproc=4, pp=2, micro_batches=2), "'torch-ddp' does not run on pipeline"),
    (dict(strategy="torch-fsdp2-tp", nproc=4, tp=4), "dp x tp"),
    (dict(strategy="torch-fsdp2", nproc=2, return_optimizer_state=True), "not for 'torch-fsdp2'"),
    (dict(strategy="torch-fsdp2-tp", nproc=8, tp=2, pp=2, micro_batches=4, schedule="zbv"),
     "split backward"),
])
def test_what_does_not_compose_fails_before_launch(kw, message):
    with pytest.raises(LayoutError, match=message):
        validate(LabConfig(model=SMALL, **kw))


def test_fsdp2_on_our_tp_is_refused_where_tp_ranks_share_a_kv_head():
    """Ranks sharing a K/V head sum its gradient in a hook on the parameter, which FSDP2's
    fully_shard replaces: the layout ran 0.32 off single (make test-full's whole pairwise
    cover, w8 torch-fsdp2-gradop tp4 llama); now refused before launch, in one line."""
    from dataclasses import replace

    llama = replace(SMALL, arch="llama", n_kv_heads=2)
    for strategy in ("torch-fsdp2", "torch-fsdp2-gradop"):
        with pytest.raises(LayoutError, match="above the 2 key/value heads") as refused:
            validate(LabConfig(strategy=strategy, nproc=8, tp=4, model=llama))
        assert "\n" not in str(refused.value)
        validate(LabConfig(strategy=strategy, nproc=4, tp=2, model=llama))   # one head each


def test_cli_checkpoint_flags(tmp_path):
    from refimpl.lab.cli import build_parser, config_from_args, main

    args = build_parser().parse_args(["train", "--strategy", "zero1", "--nproc", "4", "--pp", "2",
                                      "--save-state", str(tmp_path / "a.pt"),
                                      "--init-state", str(tmp_path / "b.pt"),
                                      "--save-optimizer-state", str(tmp_path / "c.pt"),
                                      "--init-optimizer-state", str(tmp_path / "d.pt")])
    cfg = config_from_args(args)
    assert cfg.save_state == str(tmp_path / "a.pt") and cfg.init_state == str(tmp_path / "b.pt")
    assert cfg.save_optimizer_state == str(tmp_path / "c.pt")
    assert cfg.init_optimizer_state == str(tmp_path / "d.pt")
    assert main(["train", "--strategy", "zero1", "--nproc", "4",
                 "--init-state", str(tmp_path / "missing.pt")]) == 2
