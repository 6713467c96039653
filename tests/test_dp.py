"""Data parallelism: dp-naive, bucketed/overlapped dp and PyTorch's DDP compute what `single` does.

All runs of a world size share one launch (tests/data_parallel_runs.py).
"""
import pytest
import torch

from refimpl.config import TrainConfig
from refimpl.lab.trace.profiling import load_trace, summarize
from refimpl.lab.verify.equivalence import compare_states
from refimpl.memory import model_state_bytes
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig, build_model
from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import assign_buckets
from refimpl.train import validate
from tests.data_parallel_runs import ELEMENT, assert_matches_single, reference, runs_on, single_accumulating

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

DP = ["dp-naive", "dp", "dp-micro2", "torch-ddp"]


# 4 ranks: make test-full's (the layout matrix runs every flavour on 2, 3, 4 and 8 ranks)
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.full)])
@pytest.mark.parametrize("name", DP)
def test_same_losses_and_weights_as_single(world, name):
    assert_matches_single(*runs_on(world, "dp")[name])


@pytest.mark.parametrize("name", ["torch-ddp-micro2", "dp-checkpointing"])
def test_accumulation_and_checkpointing_variants_match_single(name):
    assert_matches_single(*runs_on(2, "dp")[name])


@pytest.mark.parametrize("name", ["dp-naive", "dp", "torch-ddp"])
def test_two_ranks_are_bit_exact_with_single_accumulating_their_halves(name):
    # Rank r's gradient is single's r-th micro-batch gradient, bit for bit; a + b = b + a.
    cfg, result = runs_on(2, "dp")[name]
    ref = single_accumulating(2, cfg.global_batch)
    *_, exact = compare_states(result["state_dict"], ref["state_dict"])
    assert exact and result["losses"] == ref["losses"]


def test_bf16_autocast_keeps_fp32_master_weights_and_tracks_single():
    cfg, result = runs_on(2, "dp")["dp-bf16"]
    ref = reference(cfg)
    assert max(abs(a - b) / b for a, b in zip(result["losses"], ref["losses"])) < 1e-2
    assert all(v.dtype == torch.float32 for v in result["state_dict"].values())
    assert result["memory"][0]["params"] == 4 * result["n_params"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["dp-naive", "dp", "torch-ddp"])
def test_replicas_hold_every_byte_of_model_state(world, name):
    # Plain DP shards nothing and pads nothing: N params, N grads, 2N Adam moments per rank.
    cfg, result = runs_on(world, "dp")[name]
    n = result["n_params"]
    e = ELEMENT[cfg.dtype]
    want = model_state_bytes(n, dp=world, zero_stage=0, param_bytes=e, grad_bytes=e,
                             optimizer_bytes=2 * e, padded=False)
    for mem in result["memory"]:
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (
            want.params, want.grads, want.optimizer)


def test_checkpointing_lowers_measured_activations():
    plain = runs_on(2, "dp")["dp"][1]["memory"][0]["activations_peak"]
    assert runs_on(2, "dp")["dp-checkpointing"][1]["memory"][0]["activations_peak"] < plain


def test_buckets_follow_reverse_parameter_order_and_cover_every_gradient():
    model = build_model(GPTConfig(), 0)
    layout = FlatParams(list(model.named_parameters()), world_size=3)
    buckets = assign_buckets(layout, cap_bytes=0.25 * 2 ** 20)
    assert len(buckets) > 1
    assert buckets[0].end == layout.padded_numel and buckets[-1].start == 0
    assert all(a.start == b.end for a, b in zip(buckets, buckets[1:]))      # contiguous, descending
    assert buckets[0].params[-1] == len(layout.slots) - 1                   # lm_head goes first
    cut = layout.shard_numel
    split = assign_buckets(layout, cap_bytes=25 * 2 ** 20, cut_at=[cut, 2 * cut])
    assert [b.start for b in split] == [2 * cut, cut, 0]                   # one owner each


def test_bucketed_dp_traces_label_comm_on_every_rank_and_hide_some_of_it():
    cfg, result = runs_on(2, "dp")["dp-profiled"]
    df = load_trace(result["trace_dir"])
    labelled = df[(df.category == "comm") & df.name.str.startswith("comm:all_reduce")]
    assert set(labelled["rank"]) == {0, 1}
    n_buckets = labelled[(labelled["rank"] == 0) & labelled.step.notna()].groupby("step").size()
    assert (n_buckets > 2).all()                   # several buckets + the loss, every step
    summary = summarize(df)
    assert (summary.comm_hidden_frac > 0).all()    # some all-reduce ran during backward


def test_layout_errors_are_one_line_before_launch():
    with pytest.raises(LayoutError, match="multiple of 3 data-parallel"):
        validate(TrainConfig(strategy="dp", nproc=3, global_batch=8))
    with pytest.raises(LayoutError, match="no option"):
        validate(TrainConfig(strategy="dp", nproc=2, options={"bucket_size": 1}))
    with pytest.raises(LayoutError, match="bucket_mb"):
        validate(TrainConfig(strategy="dp", nproc=2, options={"bucket_mb": 0}))
