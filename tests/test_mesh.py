"""The rank grid: groups as DESIGN.md lays them out, and every data-parallel strategy confined to
its dp axis.

The grid test puts two independent dp pairs side by side (an outermost `replica` axis on 4 ranks):
each pair must reproduce `single` on its own, and no collective may be issued on the default
group. A collective that leaked onto it would either mix the two pairs (4 ranks summing where 2
should: wrong weights) or be caught by the guard, which records every torch.distributed call
made without an explicit group.
"""
import pytest
import torch

from refimpl import launch
from refimpl.lab.config import LabConfig
from refimpl.lab.plots.placement import describe_grid
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_states, reference_run
from refimpl.mesh import LayoutError, ParallelDims
from refimpl.train import validate
from tests.models import SMALL

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

DP_FAMILY = ["dp-naive", "dp", "zero1", "zero2", "zero3", "fsdp", "torch-ddp", "torch-zero1",
             "torch-fsdp2"]
GUARDED = ["all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
           "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter",
           "barrier", "all_gather_object", "send", "recv", "isend", "irecv"]


def test_groups_follow_the_design_grid():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_groups_split_the_data_parallel_ranks():
    dims = ParallelDims(dp=4, ep=2)
    assert dims.groups("ep") == [[0, 1], [2, 3]]          # experts spread over neighbours
    assert dims.groups("edp") == [[0, 2], [1, 3]]         # the ranks holding the same experts
    dims = ParallelDims(dp=2, cp=2, tp=2)
    assert dims.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_every_rank_is_in_exactly_one_group_per_axis():
    dims = ParallelDims(dp=2, pp=3, cp=1, tp=2, ep=2)
    for axis in ("dp", "pp", "cp", "tp", "dp_cp", "ep", "edp"):
        members = sorted(r for g in dims.groups(axis) for r in g)
        assert members == list(range(dims.world_size)), axis
        assert all(len(g) == dims.size(axis) for g in dims.groups(axis)), axis
    rows = describe_grid(dims)
    assert [r["rank"] for r in rows] == list(range(12))
    assert rows[7]["tp_group"] == [6, 7] and rows[7]["pp_group"] == [7, 9, 11]


@pytest.mark.parametrize("changes, words", [
    (dict(nproc=6, tp=4), "multiple of pp x cp x tp"),
    (dict(nproc=4, ep=3), "--ep 3 must divide"),
    (dict(nproc=4, tp=0), "--tp must be a positive integer"),
    (dict(nproc=4, replicas=2, global_batch=5), "multiple of 2 data-parallel"),
])
def test_bad_grids_fail_before_launch_with_one_line(changes, words):
    with pytest.raises(LayoutError) as err:
        validate(LabConfig(strategy="dp", **changes))
    assert words in str(err.value) and "\n" not in str(err.value)


def _train_guarded(rank, world_size, cfgs):
    """train_rank for each configuration, recording collectives issued without a group."""
    import torch.distributed as dist

    from refimpl.seam import current_name
    from refimpl.train import train_rank

    ungrouped = []
    for name in map(current_name, GUARDED):   # the names the installed torch's calls go through
        original = getattr(dist, name)

        def guarded(*args, _original=original, _name=name, **kwargs):
            group = kwargs.get("group")
            if group is None or group is dist.group.WORLD:
                ungrouped.append(_name)
            return _original(*args, **kwargs)
        setattr(dist, name, guarded)
    results = [train_rank(rank, world_size, cfg) for cfg in cfgs]
    return {"results": results, "ungrouped": ungrouped}


@pytest.fixture(scope="module")
def replica_runs():
    cfgs = [LabConfig(strategy=s, nproc=4, replicas=2, steps=3, return_state=True, dtype="float64",
                      model=SMALL,
                      options={"bucket_mb": 0.25} if s in ("dp", "zero1", "zero2") else {})
            for s in DP_FAMILY]
    for cfg in cfgs:
        validate(cfg)
    return cfgs, launch.run(_train_guarded, 4, cfgs, timeout=900, quiet=True)


def test_no_collective_runs_on_the_default_group(replica_runs):
    _, per_rank = replica_runs
    for rank, out in enumerate(per_rank):
        assert out["ungrouped"] == [], f"rank {rank} issued {out['ungrouped']} on the default group"


@pytest.mark.parametrize("i, strategy", list(enumerate(DP_FAMILY)))
def test_both_replica_pairs_equal_single(replica_runs, i, strategy):
    cfgs, per_rank = replica_runs
    ref = reference_run(cfgs[i].with_(nproc=2, replicas=1))
    for rank in (0, 2):                      # the first rank of each pair
        got = per_rank[rank]["results"][i]
        assert max(abs(a - b) / b for a, b in zip(got["losses"], ref["losses"])) <= FP64_TOLERANCE
        whole, _, _ = compare_states(got["state_dict"], ref["state_dict"])
        assert whole <= FP64_TOLERANCE, (strategy, rank, whole)
    # The two pairs are independent copies of the same computation: identical to the bit.
    a, b = (per_rank[r]["results"][i]["state_dict"] for r in (0, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
