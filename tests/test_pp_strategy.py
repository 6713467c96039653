"""The pipeline strategies in the loop: pp-gpipe, pp-1f1b, pp-interleaved, pp-zb and PyTorch's
twins reproduce `single` (losses and final weights after 3 AdamW steps) on 2, 3 (uneven: 4 blocks
over 3 stages) and 4 ranks; dp x pp and two independent replicas too; bad layouts fail before launch.
"""
import functools

import pytest

from refimpl.lab.cli import build_parser, config_from_args
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig
from refimpl.train import validate
from tests.models import SMALL

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)


def cfg(strategy, world, m, *, pp=None, v=1, layers=4, batch=8, **kw):
    return LabConfig(strategy=strategy, nproc=world, pp=pp or world, steps=3, global_batch=batch,
                     micro_batches=m, virtual_stages=v, return_state=True, dtype="float64",
                     model=GPTConfig(**{**SMALL.to_dict(), "n_layers": layers}), **kw)


# The schedules on 2, 3 and 4 stages, ours and PyTorch's, each equal to single: make test-full's
# (the layout matrix, tests/test_layout_matrix.py, runs every schedule with every data-parallel
# flavour and each twin in make test). make test keeps the run the stage-memory test reads.
RUNS = {
    "4": {"pp-1f1b m2": cfg("pp-1f1b", 4, 2)},
    "2-full": {"pp-gpipe m2": cfg("pp-gpipe", 2, 2), "pp-1f1b m1": cfg("pp-1f1b", 2, 1),
        "pp-1f1b m4": cfg("pp-1f1b", 2, 4), "pp-interleaved v2 m2": cfg("pp-interleaved", 2, 2, v=2),
        "pp-zb m4": cfg("pp-zb", 2, 4), "dp-naive --pp 2 zb": cfg("dp-naive", 2, 2, schedule="zb-h1"),
        "torch-pp-gpipe m2": cfg("torch-pp-gpipe", 2, 2), "torch-pp-1f1b m2": cfg("torch-pp-1f1b", 2, 2),
        "torch-pp-interleaved v2 m2": cfg("torch-pp-interleaved", 2, 2, v=2),
        # the frontier, ours and PyTorch's
        "pp-interleaved-zb v2 m2": cfg("pp-interleaved-zb", 2, 2, v=2), "pp-zbv m4": cfg("pp-zbv", 2, 4),
        "pp-dualpipev m4": cfg("pp-dualpipev", 2, 4),
        "torch-pp-interleaved-zb v2 m2": cfg("torch-pp-interleaved-zb", 2, 2, v=2),
        "torch-pp-zbv m4": cfg("torch-pp-zbv", 2, 4), "torch-pp-dualpipev m4": cfg("torch-pp-dualpipev", 2, 4)},
    "3-full": {"pp-gpipe m3": cfg("pp-gpipe", 3, 3, batch=12), "pp-1f1b m2": cfg("pp-1f1b", 3, 2, batch=12),
        "pp-zb m4": cfg("pp-zb", 3, 4, batch=12), "torch-pp-1f1b m3": cfg("torch-pp-1f1b", 3, 3, batch=12)},
    "4-full": {"pp-interleaved v2 m4": cfg("pp-interleaved", 4, 4, v=2, layers=8),
        "pp-zb m4": cfg("pp-zb", 4, 4), "dp2 x pp2 1f1b": cfg("pp-1f1b", 4, 2, pp=2),
        "2 replicas of pp2": cfg("pp-gpipe", 4, 2, pp=2, replicas=2),
        "torch-pp-gpipe m4": cfg("torch-pp-gpipe", 4, 4),
        "pp-interleaved-zb v2 m4": cfg("pp-interleaved-zb", 4, 4, v=2, layers=8),
        "pp-zbv m4": cfg("pp-zbv", 4, 4, layers=8), "pp-dualpipev m8": cfg("pp-dualpipev", 4, 8, layers=8),
        "dp-naive dp2 x pp2 --schedule zbv": cfg("dp-naive", 4, 2, pp=2, schedule="zbv"),
        "zero1 dp2 x pp2 --schedule dualpipev": cfg("zero1", 4, 4, pp=2, schedule="dualpipev"),
        "zero2 dp2 x pp2 --schedule interleaved-zb": cfg("zero2", 4, 2, pp=2, v=2,
                                                          schedule="interleaved-zb")},
}


@functools.lru_cache(maxsize=None)
def results(world):
    names = list(RUNS[world])
    return dict(zip(names, train_several_on_ranks([RUNS[world][n] for n in names], timeout=900)))


@pytest.mark.parametrize("world,name", [
    pytest.param(w, n, marks=[pytest.mark.full] if w.endswith("full") else [])
    for w, runs in RUNS.items() for n in runs])
def test_pipeline_strategies_match_single(world, name):
    config, result = RUNS[world][name], results(world)[name]
    eq = compare_with_single(config, result)
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, (eq.loss_rel_err, eq.weight_rel_err)
    assert len({tuple(r["losses"]) for r in result["per_rank"]}) == 1   # every rank returns the loss


def test_each_stage_holds_only_its_parameters():
    result = results("4")["pp-1f1b m2"]
    params = [r["memory"]["params"] for r in result["per_rank"]]
    assert sum(params) == 8 * result["n_params"]          # float64: the stages partition the model
    assert params[0] > params[1] and params[3] > params[1]  # embedding first, head last


@pytest.mark.parametrize("changes,words", [
    (dict(strategy="pp-1f1b", nproc=4, pp=4, model=GPTConfig(n_layers=3)), "at least as many"),
    (dict(strategy="pp-interleaved", nproc=2, pp=2, virtual_stages=2, micro_batches=2,
          model=GPTConfig(n_layers=3)),
     "at least as many"),
    (dict(strategy="pp-1f1b", nproc=2, pp=2, micro_batches=3, global_batch=8), "multiple"),
    (dict(strategy="pp-interleaved", nproc=2, pp=2, virtual_stages=2, micro_batches=3, global_batch=6),
     "multiple of pipeline stages"),
    (dict(strategy="torch-pp-1f1b", nproc=4, pp=4, micro_batches=2), ">= stages"),
    (dict(strategy="pp-1f1b", nproc=2, tp=2), "pipeline parallelism needs >= 2"),
    (dict(strategy="torch-ddp", nproc=2, pp=2), "does not run on pipeline stages"),  # dp, zero*, fsdp do
    (dict(strategy="pp-gpipe", nproc=2, pp=2, schedule="1f1b"), "drop --schedule"),
    (dict(strategy="pp-zb", nproc=2, pp=2, activation_checkpointing=True), "checkpointing"),
    (dict(strategy="pp-dualpipev", nproc=2, pp=2, micro_batches=2), ">= 2 x stages"),
    (dict(strategy="pp-zbv", nproc=2, pp=2, virtual_stages=3, micro_batches=2, model=GPTConfig(n_layers=6)),
     "exactly two chunks"),
    (dict(strategy="pp-zbv", nproc=2, pp=2, micro_batches=2, model=GPTConfig(n_layers=3)), "at least as many"),
    (dict(strategy="torch-pp-interleaved-zb", nproc=2, pp=2, micro_batches=2), "--virtual-stages >= 2"),
])
def test_bad_pipeline_layouts_fail_before_launch_with_one_line(changes, words):
    with pytest.raises(LayoutError) as err:
        validate(LabConfig(**changes))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_cli_shorthand_puts_the_whole_world_on_pp():
    args = build_parser().parse_args(["train", "--strategy", "pp-interleaved", "--nproc", "4",
                                      "--virtual-stages", "2", "--micro-batches", "4", "--layers", "8"])
    config = validate(config_from_args(args)).cfg      # the registry fills the shorthand's axis
    assert (config.pp, config.dims.dp, config.virtual_stages) == (4, 1, 2)
    # the ranks the other axes leave: tp 2 x pp 2, the same layout as dp-naive with --pp 2
    args = build_parser().parse_args(["train", "--strategy", "pp-1f1b", "--nproc", "4", "--tp", "2"])
    shorthand = validate(config_from_args(args))
    spelled_out = validate(config_from_args(build_parser().parse_args(
        ["train", "--strategy", "dp-naive", "--nproc", "4", "--tp", "2", "--pp", "2",
         "--schedule", "1f1b"])))
    assert shorthand.strategy is spelled_out.strategy
    assert shorthand.cfg.with_(strategy="dp-naive") == spelled_out.cfg
    args = build_parser().parse_args(["train", "--strategy", "dp-naive", "--nproc", "4", "--pp", "2",
                                      "--schedule", "zb-h1", "--micro-batches", "2"])
    config = config_from_args(args)
    assert (config.pp, config.dims.dp, config.schedule) == (2, 2, "zb-h1")
