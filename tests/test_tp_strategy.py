"""Tensor parallelism through the training loop: `--strategy tp`, `--tp T` under data-parallel
flavours, `--sequence-parallel`, and PyTorch's twin `torch-tp`, each against `single`.

One launch per world size; on 4 ranks every collective is also checked to carry an explicit group
(tests/test_mesh.py's guard), including a layout of two independent tp pairs side by side.
"""
import functools
from dataclasses import replace

import pytest

from refimpl import launch
from refimpl.lab.cli import main as cli
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_states, compare_with_single
from refimpl.mesh import LayoutError
from refimpl.registry import resolve
from refimpl.train import merge_results, validate
from tests.models import SMALL
from tests.test_mesh import _train_guarded

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)


def base(world, strategy, **kw):
    return LabConfig(strategy=strategy, nproc=world, steps=3, return_state=True,
                     dtype="float64", model=SMALL).with_(**kw)


RUNS = {
    2: {"tp": base(2, "tp"), "tp+sp": base(2, "tp", sequence_parallel=True),
        "torch-tp": base(2, "torch-tp"), "torch-tp+sp": base(2, "torch-tp", sequence_parallel=True),
        "tp+sp, refimpl collectives": base(2, "tp", sequence_parallel=True, collectives="refimpl")},
    4: {"tp": base(4, "tp"), "tp+sp": base(4, "tp", sequence_parallel=True),
        "tp vocab 126": base(4, "tp", model=replace(SMALL, vocab_size=126)),   # padded to 128
        "zero1 --tp 2": base(4, "zero1", tp=2),
        "dp --tp 2 +sp micro2": base(4, "dp", tp=2, sequence_parallel=True, micro_batches=2),
        "tp, 2 replicas": base(4, "tp", replicas=2),
        "torch-tp+sp": base(4, "torch-tp", sequence_parallel=True)},
}
CASES = [(w, name) for w in RUNS for name in RUNS[w]]


@functools.cache
def runs_on(world):
    cfgs = list(RUNS[world].values())
    if world == 2:
        return {"results": dict(zip(RUNS[world], train_several_on_ranks(cfgs, timeout=900))),
                "ungrouped": []}
    for cfg in cfgs:
        validate(cfg)
    per_rank = launch.run(_train_guarded, world, cfgs, timeout=900, quiet=True)
    merged = [merge_results(cfg, [r["results"][i] for r in per_rank]) for i, cfg in enumerate(cfgs)]
    return {"results": dict(zip(RUNS[world], merged)),
            "ungrouped": [u for r in per_rank for u in r["ungrouped"]]}


@pytest.mark.parametrize("world, name", CASES)
def test_same_losses_and_weights_as_single(world, name):
    cfg, result = RUNS[world][name], runs_on(world)["results"][name]
    if cfg.replicas > 1:                           # each pair is a tp=2 layout of its own
        cfg = cfg.with_(nproc=2, replicas=1)
    eq = compare_with_single(cfg, result)
    # float64: TP's split sums reorder the matmuls' additions, ~1e-16 each; AdamW leaves the
    # weights ~1e-14 apart, far under the gate (refimpl.lab.verify.equivalence).
    assert eq.tolerance == FP64_TOLERANCE
    assert eq.loss_rel_err <= FP64_TOLERANCE, (name, eq.losses, eq.reference_losses)
    assert eq.weight_rel_err <= FP64_TOLERANCE, (name, eq.weight_rel_err)


def test_every_collective_has_a_group_and_tp_pairs_stay_apart():
    out = runs_on(4)
    assert out["ungrouped"] == []
    per_rank = out["results"]["tp, 2 replicas"]["per_rank"]
    a, b = (per_rank[r]["state_dict"] for r in (0, 2))   # pairs {0,1} and {2,3}: same to the bit
    *_, exact = compare_states(a, b)
    assert exact


@pytest.mark.parametrize("world", [2, 4])
def test_torch_tp_twin_has_the_same_losses(world):
    res = runs_on(world)["results"]
    ours = res["tp+sp"]["losses"]
    assert max(abs(a - b) / b for a, b in zip(ours, res["torch-tp+sp"]["losses"])) <= FP64_TOLERANCE


def test_parameters_per_rank_shrink_with_tp():
    res = runs_on(4)["results"]
    n = res["tp"]["n_params"]
    four, two = res["tp"]["memory"][0]["params"], res["zero1 --tp 2"]["memory"][0]["params"]
    # 1/t of everything but the replicated LayerNorms, row biases and position table (float64)
    assert n * 8 / 4 < four < n * 8 / 4 * 1.1 and n * 8 / 2 < two < n * 8 / 2 * 1.1
    assert res["torch-tp+sp"]["memory"][0]["params"] == four


def test_shorthand_puts_the_whole_world_on_tp():
    assert resolve(LabConfig(strategy="tp", nproc=4)).cfg.tp == 4
    assert resolve(LabConfig(strategy="tp", nproc=4, replicas=2)).cfg.tp == 2
    assert resolve(LabConfig(strategy="zero1", nproc=4, tp=2)).cfg.dims.dp == 2


@pytest.mark.parametrize("cfg, words", [
    (LabConfig(strategy="tp", nproc=3, global_batch=6), "attention heads (8)"),
    (LabConfig(strategy="tp", nproc=4, seq_len=30, sequence_parallel=True), "--seq-len (30)"),
    (LabConfig(strategy="dp", nproc=2, sequence_parallel=True), "needs --tp > 1"),
    (LabConfig(strategy="torch-tp", nproc=4, tp=2), "does not compose"),
])
def test_layouts_tp_cannot_run_fail_before_launch_in_one_line(cfg, words):
    with pytest.raises(LayoutError) as err:
        validate(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_cli_exits_2_naming_the_constraint(capsys):
    assert cli(["train", "--strategy", "dp", "--tp", "3", "--nproc", "3", "--global-batch", "6"]) == 2
    assert "attention heads" in capsys.readouterr().err


def test_rebuilt_collectives_carry_exactly_the_sequence_parallel_traffic():
    # --collectives refimpl: every TP collective goes through refimpl.comm's ring, whose counter
    # sees (t-1)/t of each all-gathered / reduce-scattered b·s·h message per rank. Per step:
    # 2 per block + 1 (embedding, LM head) in forward, as many in backward.
    from tests.test_collectives_seam import _train_counting

    cfg = LabConfig(strategy="tp", nproc=2, steps=1, sequence_parallel=True, collectives="refimpl")
    (sent, _), _ = launch.run(_train_counting, 2, cfg, timeout=600, quiet=True)
    message, layers = cfg.global_batch * cfg.seq_len * cfg.model.d_model * 4, cfg.model.n_layers
    assert sent["all_gather"] == sent["reduce_scatter"] == 2 * (2 * layers + 1) * message / 2
