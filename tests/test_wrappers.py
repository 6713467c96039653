"""DataParallel, ShardedOptimizer and FullyShard around models unlike refimpl's GPT, and PyTorch's
twins (DDP, ZeroRedundancyOptimizer, fully_shard) through the same checks.

Every check of a world size runs in one launch (tests/wrapper_runs.py: the models, the loops and
what each check returns); each rank's result is compared here with plain training on the whole
batch, float64 at refimpl's 1e-9 gate.
"""
import functools
import math

import pytest
import torch

from refimpl.lab.verify.equivalence import FP64_TOLERANCE
from refimpl.launch import run
from tests.wrapper_runs import every_check

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

WORLDS = [2, 3]
FLOAT64 = [(kind, case, who) for kind in ("dp", "zero", "fsdp") for case in ("tied", "spare")
           for who in ("ours", "torch")] + [
    ("dp", "tied", "ours-no_sync"), ("dp", "tied", "torch-no_sync"),
    ("fsdp", "tied", "ours-named-units"), ("fsdp", "tied", "ours-class-units"),
    ("zero", "tied", "ours-flat"), ("zero", "spare", "ours-flat"),
    ("zero", "tied", "ours-flat-offload")]
# fp32: the distance to fp32 plain training after 3 steps is a few units of fp32 round-off
# (2^-24 ~ 6e-8 per operation; ~3e-8 measured); bf16 compute: a few units of bf16's 2^-8.
FP32_TOLERANCE = 1e-6
BF16_TOLERANCE = {"weights": 5e-2, "losses": 1e-2}


@functools.cache
def checks(world: int) -> list[dict]:
    return run(every_check, world, timeout=300)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("key", FLOAT64, ids="-".join)
def test_equal_to_plain_training_on_the_whole_batch(world, key):
    # frozen parameters never change; a parameter the forward does not use ends with no
    # gradient (None, or zero where the wrapper keeps a gradient buffer for it)
    for rank, res in enumerate(checks(world)):
        r = res[key]
        assert r["weights"] <= FP64_TOLERANCE and r["losses"] <= FP64_TOLERANCE, (rank, r)
        assert r["frozen_unchanged"] and r["unused_grad_empty"], (rank, r)


@pytest.mark.parametrize("world", WORLDS)
def test_frozen_parameters_are_never_communicated_and_a_tied_weight_is_reduced_once(world):
    for res in checks(world):
        for key, r in res.items():
            if key != "bad" and "frozen_communicated" in r:
                assert not r["frozen_communicated"], key
        assert res["dp", "tied", "ours"]["tied_slots"] == 1     # one slot in the buckets
        assert res["dp", "tied", "ours"]["buckets"] > 1         # several buckets went out


@pytest.mark.parametrize("world", WORLDS)
def test_fully_shard_keeps_one_padded_shard_per_unit(world):
    for res in checks(world):
        for key in [k for k in FLOAT64 if k[0] == "fsdp" and k[2].startswith("ours")]:
            r = res[key]
            total = sum(r["unit_numels"])
            assert r["local_share"] == sum(math.ceil(n / world) for n in r["unit_numels"]) / total
            assert r["names_match"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["tied", "spare"])
@pytest.mark.parametrize("who", ["ours", "ours-flat"])
def test_sharded_optimizer_holds_a_partition_and_saves_the_whole_state(world, case, who):
    results = [res["zero", case, who] for res in checks(world)]
    shares = [r["state_share"] for r in results]
    if who == "ours-flat":      # exactly ceil(Ψ/N) elements each, the last shard's padding too
        psi = results[0]["elements"]
        assert all(abs(s - math.ceil(psi / world) / psi) < 1e-12 for s in shares), shares
    else:
        assert all(s < 1 for s in shares) and abs(sum(shares) - 1) < 1e-12   # each element once
    for rank, r in enumerate(results):
        # the consolidated state is plain SGD's / AdamW's, to the last bits...
        assert r["state_dict_err"] <= FP64_TOLERANCE, (rank, r)
        if case == "tied":      # (spare: ours also holds the zero-gradient parameters' state)
            assert r["state_dict_keys_match"]
        # ...and resumes on one rank fewer as plain training's next step does
        if rank < world - 1:
            assert r["resumed"] <= FP64_TOLERANCE, (rank, r)


@pytest.mark.parametrize("case", ["tied", "spare"])
def test_a_flat_state_saved_on_two_ranks_continues_on_three_and_in_a_plain_optimizer(case):
    for rank, res in enumerate(checks(3)):
        r = res["flat_moves", case]
        assert r["resumed"] <= FP64_TOLERANCE and r["plain"] <= FP64_TOLERANCE, (rank, r)


@pytest.mark.parametrize("world", WORLDS)
def test_flat_offload_keeps_the_master_on_the_host_and_changes_no_bit(world):
    for res in checks(world):
        on, off = res["zero", "tied", "ours-flat-offload"], res["zero", "tied", "ours-flat"]
        assert all(torch.equal(on["final"][k], v) for k, v in off["final"].items())
        shard_bytes = math.ceil(on["elements"] / world) * 8          # float64
        # on the host: the gradient shard; the master shard, m and v (the ZeRO paper's K = 12 in
        # fp32), counted as optimizer state
        assert on["host_state"] == (0, shard_bytes, 3 * shard_bytes) and on["master_on_host"]
        assert off["host_state"] == (0, 0, 0)


@pytest.mark.parametrize("world", WORLDS)
def test_fp32_and_bf16_compute_within_their_round_off(world):
    for res in checks(world):
        for kind in ("dp", "fsdp"):
            r = res[kind, "tied", "ours-fp32"]
            assert r["weights"] <= FP32_TOLERANCE and r["losses"] <= FP32_TOLERANCE, r
        bf16 = res["fsdp", "tied", "ours-bf16"]
        assert all(bf16[k] <= tol for k, tol in BF16_TOLERANCE.items()), bf16
        # and the weights really were used in bf16: far beyond fp32's distance
        assert bf16["weights"] > 100 * res["fsdp", "tied", "ours-fp32"]["weights"]


@pytest.mark.parametrize("world", WORLDS)
def test_bad_use_fails_in_one_line(world):
    for rank, res in enumerate(checks(world)):
        said = res["bad"]
        for key, text in said.items():
            assert "\n" not in text, (key, text)
        for key in ("dp_twice", "dp_of_dp", "fsdp_of_dp"):
            assert "already wrapped" in said[key], said[key]
        for key in ("dp_device", "fsdp_device", "zero_device"):
            assert "wants" in said[key], said[key]
        assert "one parameter group" in said["flat_groups"], said["flat_groups"]
        assert "partition='flat'" in said["tensors_offload"], said["tensors_offload"]
        if rank > 0:
            for key in ("dp_group", "fsdp_group", "zero_group"):
                assert "not in the group" in said[key], said[key]
