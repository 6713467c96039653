"""Experts composed with the other axes: MoE blocks inside pipeline stages (every schedule), under
context parallelism, and `ep` with both, equal to `single` (losses and weights, float64).

What must hold for that (refimpl.model.moe, refimpl.model.moe_sequence):
  * the aux loss of every stage's MoE layers joins the step's loss as single sums it (runner.py);
  * DeepSeek-V3's bias moves by the whole step's load, summed over micro-batches and ranks;
  * capacity and f_i count the same tokens as single's: the default (batch) scope where a forward
    holds single's tokens in single's order, the sequence scope everywhere else.

make test keeps one launch (4 ranks: dp2 x pp2 with ep over dp on a split schedule, aux balance;
dp2 x cp2 with ep over dp x cp, bias balance) and the checks without ranks; every other pairing
is `full` (make test-full).
"""
import atexit
import functools
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from refimpl.config import TrainConfig
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.measure import moe_collectives
from refimpl.lab.measure.ep_load import dropped_by_step, expert_frame
from refimpl.lab.trace.profiling import load_trace
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single, reference_run
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig, build_model, lm_loss, synthetic_batch
from refimpl.model.activation_checkpointing import checkpoint_blocks
from refimpl.model.moe import moe_layers
from refimpl.registry import resolve
from refimpl.train import train_on_ranks, validate

TWO = GPTConfig(vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4)
FOUR = replace(TWO, n_layers=4)     # V and interleaved schedules: two pieces per rank
TIGHT = dict(top_k=2, capacity_factor=0.75)               # some assignments overflow every step
AUX = dict(TIGHT, balance="aux")
BIAS = dict(TIGHT, balance="bias", bias_gamma=0.01)
SEQ = dict(capacity_scope="sequence")
WORK = Path(tempfile.mkdtemp(prefix="refimpl-moe-compose-"))   # the traced layout's trace
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


def config(strategy: str, nproc: int, model=TWO, moe=(), **layout) -> TrainConfig:
    return LabConfig(strategy=strategy, nproc=nproc, steps=2, global_batch=8, seq_len=16,
                     model=replace(model, **dict(moe)), return_state=True, dtype="float64",
                     **layout)


CASES = {
    4: {  # make test: one launch, two layouts
        "dp2 x pp2, ep over dp, zb-h1, aux": config("ep", 4, pp=2, schedule="zb-h1", micro_batches=2,
                                                    moe={**AUX, **SEQ}),
        # traced: test_cp_collectives_are_the_arithmetics
        "dp2 x cp2, ep over dp x cp, bias": config("ep", 4, cp=2, moe={**BIAS, **SEQ}, profile=True,
                                                   trace_dir=str(WORK / "dp2-cp2")),
    },
    "full-2": {
        # dp = 1: a forward holds single's micro-batch, so the default (batch) scope is exact
        "pp2 1f1b, aux, batch scope": config("pp-1f1b", 2, pp=2, micro_batches=2, moe=AUX),
        "pp2 zb-h1, bias, batch scope": config("pp-zb", 2, pp=2, micro_batches=4, moe=BIAS),
        "pp2 interleaved-zb, aux": config("pp-interleaved-zb", 2, pp=2, model=FOUR, virtual_stages=2,
                                          micro_batches=2, moe={**AUX, **SEQ}),
        "pp2 zbv, bias": config("pp-zbv", 2, pp=2, model=FOUR, micro_batches=2, moe={**BIAS, **SEQ}),
        "pp2 dualpipev, aux": config("pp-dualpipev", 2, pp=2, model=FOUR, micro_batches=4, moe={**AUX, **SEQ}),
        "pp2 1f1b, bias, checkpointing": config("pp-1f1b", 2, pp=2, micro_batches=2, moe=BIAS,
                                                activation_checkpointing=True),
        "cp2, experts replicated, aux": config("dp-naive", 2, cp=2, moe={**AUX, **SEQ}),
        "cp2, ep over cp, bias": config("ep", 2, cp=2, moe={**BIAS, **SEQ}),
        "cp2, ep over cp, aux": config("ep", 2, cp=2, moe={**AUX, **SEQ}),
        # the other data-parallel flavours over the replicated experts, under cp
        "cp2, dp (bucketed), bias": config("dp", 2, cp=2, moe={**BIAS, **SEQ}),
    },
    "full-4": {
        "dp2 x pp2, ep over dp, 1f1b, bias": config("ep", 4, pp=2, schedule="1f1b", micro_batches=2,
                                                    moe={**BIAS, **SEQ}),
        "dp2 x pp2, ep over dp, zbv, aux": config("ep", 4, pp=2, schedule="zbv", model=FOUR,
                                                  micro_batches=2, moe={**AUX, **SEQ}),
        "dp2 x pp2, experts replicated, aux": config("pp-1f1b", 4, pp=2, micro_batches=2,
                                                     moe={**AUX, **SEQ}),
        "cp4, experts replicated, bias": config("dp-naive", 4, cp=4, moe={**BIAS, **SEQ}),
        "cp4, ep over cp, aux": config("ep", 4, cp=4, moe={**AUX, **SEQ}),
        "dp2 x cp2, ep2 inside dp x cp, aux": config("ep", 4, cp=2, ep=2, moe={**AUX, **SEQ}),
        "pp2 x cp2, experts replicated, bias": config("pp-1f1b", 4, pp=2, cp=2, micro_batches=2,
                                                      moe={**BIAS, **SEQ}),
        "dp2 x pp2, zero1, zb-h1, aux": config("zero1", 4, pp=2, schedule="zb-h1", micro_batches=2,
                                               moe={**AUX, **SEQ}),
    },
}


@functools.lru_cache(maxsize=None)
def runs(key) -> dict:
    cfgs = CASES[key]
    return dict(zip(cfgs, train_several_on_ranks(list(cfgs.values()))))


def check_equal_to_single(key, name) -> None:
    cfg = CASES[key][name]
    eq = compare_with_single(cfg, runs(key)[name])
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, eq
    ref = reference_run(cfg)
    assert min(dropped_by_step(ref)) > 0            # the capacity binds: drops must match too
    if cfg.pp == 1:     # every layer's load on rank 0 (under a pipeline: its stage's layers only)
        assert expert_frame(runs(key)[name]).equals(expert_frame(ref))
    if cfg.model.balance == "bias":                 # the bias moved (and equal: it is in the state)
        assert any(t.abs().sum() > 0 for n, t in ref["state_dict"].items() if n.endswith("expert_bias"))


@pytest.mark.ranks
@pytest.mark.parametrize("name", list(CASES[4]))
def test_experts_through_a_pipeline_and_cp_equal_single(name):
    check_equal_to_single(4, name)


@pytest.mark.ranks
def test_cp_collectives_are_the_arithmetics():
    """dp2 x cp2 with ep over dp x cp: every labelled collective of two ranks, per axis and op, is
    refimpl.lab.measure.moe_collectives' count, cp's all-gather of the pieces' counts among them (ring
    attention's hops are not labelled in a trace: `traced=False` rows, left out)."""
    cfg = CASES[4]["dp2 x cp2, ep over dp x cp, bias"]
    trace = load_trace(runs(4)["dp2 x cp2, ep over dp x cp, bias"]["trace_dir"])
    for rank in (0, 3):
        table = moe_collectives.against_trace(resolve(cfg).cfg, trace, rank)   # ep = dp x cp
        steps = [c for c in table.columns if c.startswith("step")]
        assert steps and set(table.axis) == {"ep", "cp", "dp"}, table
        assert all((table[s] == table.expected).all() for s in steps), table


@pytest.mark.ranks
@pytest.mark.full
@pytest.mark.parametrize("key,name", [(k, n) for k in ("full-2", "full-4") for n in CASES[k]])
def test_every_expert_pairing_equals_single(key, name):
    check_equal_to_single(key, name)


# --- without ranks --------------------------------------------------------------------------------

def _single(model: GPTConfig, micro_batches: int) -> dict:
    return train_on_ranks(config("single", 1, model=model, micro_batches=micro_batches))


def test_sequence_scope_does_not_see_the_micro_batches_and_batch_scope_does():
    """The order-independence the sequence scope is for, in one process: 1 or 4 micro-batches
    train the same model under it (and not under the batch scope, tight capacity and aux)."""
    seq = [_single(replace(TWO, **AUX, **SEQ), m) for m in (1, 4)]
    batch = [_single(replace(TWO, **AUX), m) for m in (1, 4)]
    seq_err = max(abs(a - b) / abs(b) for a, b in zip(seq[0]["losses"], seq[1]["losses"]))
    batch_err = max(abs(a - b) / abs(b) for a, b in zip(batch[0]["losses"], batch[1]["losses"]))
    assert seq_err < FP64_TOLERANCE < batch_err


def test_checkpointing_counts_a_forward_into_the_step_load_once():
    model = checkpoint_blocks(build_model(replace(TWO, **BIAS), seed=0).double())
    batch = synthetic_batch(model.cfg, 4, 16, 0, 0)
    lm_loss(model(batch.inputs), batch.targets).backward()     # the backward recomputes each block
    for layer in moe_layers(model):
        assert torch.equal(layer.step_load, layer.stats.routed)
        assert int(layer.step_load.sum()) == 4 * 16 * TWO.top_k


@pytest.mark.parametrize("cfg,words", [
    (config("dp-naive", 2, cp=2, moe=TIGHT), "capacity_scope=sequence"),
    (config("dp-naive", 2, micro_batches=2, moe=dict(top_k=2, capacity_factor=4.0)), "balance=aux"),
    (config("torch-pp-1f1b", 2, pp=2, micro_batches=2, moe=AUX), "PyTorch's schedules"),
    (config("dp-naive", 2, cp=2, moe=dict(capacity_scope="tokens")), "capacity_scope must be"),
])
def test_layouts_the_batch_scope_cannot_match_are_refused_in_one_line(cfg, words):
    with pytest.raises(LayoutError) as e:
        validate(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_batch_scope_runs_where_nothing_can_overflow():
    # k * capacity_factor >= E: C >= T, so the queue's order cannot matter (balance != aux)
    validate(config("dp-naive", 2, cp=2, moe=dict(top_k=2, capacity_factor=2.0, balance="bias")))


@pytest.mark.parametrize("cfg", [config("ep", 4, cp=2, tp=2, moe={**AUX, **SEQ}),
                                 config("ep", 4, pp=2, activation_checkpointing=True, moe=AUX),
                                 config("ep", 4, pp=2, schedule="zbv", model=FOUR, moe=AUX)])
def test_the_collectives_arithmetic_refuses_what_it_does_not_count(cfg):
    """tp with cp (not checked against a trace), a checkpointed block's replayed forward and a V's
    two chunks per rank are not in moe_collectives' counts (notebook 09, tests/test_composition.py
    and the cp test above check the rest against a trace): it says so rather than return a wrong
    table."""
    with pytest.raises(ValueError, match="one chunk"):
        moe_collectives.expected_calls(cfg)
