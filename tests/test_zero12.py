"""ZeRO stages 1 and 2 (and torch's ZeroRedundancyOptimizer): the same training as `single`, with
optimizer states (stage 1) and gradients (stage 2) partitioned across the ranks."""
import pytest
import torch

from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_states
from refimpl.memory import model_state_bytes
from tests.data_parallel_runs import ELEMENT, assert_matches_single, reference, runs_on, single_accumulating

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

ZERO = ["zero1", "zero2", "torch-zero1"]


# 4 ranks: make test-full's (the layout matrix runs every flavour on 2, 3, 4 and 8 ranks)
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.full)])
@pytest.mark.parametrize("name", ZERO)
def test_same_losses_and_weights_as_single(world, name):
    assert_matches_single(*runs_on(world, "zero")[name])


@pytest.mark.parametrize("name", ["zero1-flat", "zero2-flat", "zero1-offload", "zero2-offload",
                                  "zero2-checkpointing", "zero1-micro2", "zero2-micro2"])
def test_variants_match_single(name):
    assert_matches_single(*runs_on(2, "zero")[name])


@pytest.mark.parametrize("name", ZERO + ["zero2-flat", "zero2-offload"])
def test_two_ranks_are_bit_exact_with_single_accumulating_their_halves(name):
    # AdamW is elementwise: updating a flat shard is the same arithmetic as updating tensors.
    cfg, result = runs_on(2, "zero")[name]
    ref = single_accumulating(2, cfg.global_batch)
    *_, exact = compare_states(result["state_dict"], ref["state_dict"])
    assert exact and result["losses"] == ref["losses"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_measured_model_state_is_the_zero_arithmetic_to_the_byte(world, stage):
    # fp32 AdamW; flat buffers padded to world * ceil(N / world)
    cfg, result = runs_on(world, "zero")[f"zero{stage}"]
    assert (result["n_params"] % world != 0) == (world == 3)     # 3 ranks exercise the padding
    e = ELEMENT[cfg.dtype]
    want = model_state_bytes(result["n_params"], dp=world, zero_stage=stage, param_bytes=e,
                             grad_bytes=e, optimizer_bytes=2 * e)
    for mem in result["memory"]:
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (
            want.params, want.grads, want.optimizer)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_leaves_only_parameters_and_stage1_gradients_on_the_device(stage):
    cfg, result = runs_on(2, "zero")[f"zero{stage}-offload"]
    e = ELEMENT[cfg.dtype]
    want = model_state_bytes(result["n_params"], dp=2, zero_stage=stage, param_bytes=e,
                             grad_bytes=e if stage == 1 else 0, optimizer_bytes=0)
    mem = result["memory"][0]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (
        want.params, want.grads, want.optimizer)


def test_zero2_keeps_a_quarter_of_dp_gradients_on_four_ranks():
    mem = {name: runs_on(4, "zero")[name][1]["memory"][0] for name in ("dp", "zero1", "zero2")}
    assert mem["zero1"]["grads"] == mem["dp"]["grads"]
    assert runs_on(4, "zero")["dp"][1]["n_params"] % 4 == 0                 # so no padding on 4 ranks
    assert mem["zero2"]["grads"] * 4 == mem["dp"]["grads"]
    assert mem["zero1"]["optimizer"] * 4 == mem["dp"]["optimizer"]


def test_bf16_zero2_tracks_single():
    cfg, result = runs_on(2, "zero")["zero2-bf16"]
    ref = reference(cfg)
    assert max(abs(a - b) / b for a, b in zip(result["losses"], ref["losses"])) < 1e-2


def test_checkpoint_written_by_zero2_on_two_ranks_trains_dp_on_three(tmp_path):
    cfg, result = runs_on(3, "zero")["dp-from-zero2-checkpoint"]
    # What zero2 wrote is what `single` trains in its own process (not the dict it was saved from)
    trained = reference(runs_on(2, "zero")["zero2"][0])["state_dict"]
    assert compare_states(torch.load(cfg.init_state), trained)[0] <= FP64_TOLERANCE
    # and dp on three ranks, loading it, trains as `single` does from single's own weights
    torch.save(trained, tmp_path / "single.pt")
    independent = reference(cfg.with_(init_state=str(tmp_path / "single.pt")))
    assert max(abs(a - b) / b for a, b in zip(result["losses"], independent["losses"])) \
        <= FP64_TOLERANCE
    assert compare_states(result["state_dict"], independent["state_dict"])[0] <= FP64_TOLERANCE
    assert result["losses"][0] < runs_on(3, "zero")["dp"][1]["losses"][0]   # it did start from it
