"""`--collectives refimpl`: every strategy's collectives come from refimpl.comm (rebuilt from
send/recv) instead of torch.distributed, and training computes the same thing.

The rebuilt ring sums in another order than gloo's, so the comparison is with `single` at the
float64 gate, not bit for bit; the counter proves the rebuilt collectives really carried the
traffic (a seam that silently fell back to torch.distributed would send nothing through them).
"""
import pytest

from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_states, reference_run
from tests.models import SMALL

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

STRATEGIES = ["dp", "zero2", "zero3"]


def _configs(world):
    return [LabConfig(strategy=s, nproc=world, steps=3, global_batch=12 if world == 3 else 8,
                      collectives="refimpl", return_state=True, dtype="float64", model=SMALL,
                      options={"bucket_mb": 0.25} if s != "zero3" else {})
            for s in STRATEGIES]


@pytest.fixture(scope="module", params=[2, 3])
def seam_runs(request):
    cfgs = _configs(request.param)
    return cfgs, train_several_on_ranks(cfgs, timeout=900)


@pytest.mark.full     # make test: the layout matrix pairs --collectives refimpl with every strategy
def test_refimpl_collectives_train_like_single(seam_runs):
    for cfg, result in zip(*seam_runs):
        ref = reference_run(cfg)
        loss_err = max(abs(a - b) / b for a, b in zip(result["losses"], ref["losses"]))
        whole, _, _ = compare_states(result["state_dict"], ref["state_dict"])
        assert loss_err <= FP64_TOLERANCE and whole <= FP64_TOLERANCE, (cfg.strategy, loss_err, whole)


def _train_counting(rank, world_size, cfg):
    from refimpl.lab.instrument.labels import CommLog
    from refimpl.train import train_rank

    with CommLog() as counted:
        result = train_rank(rank, world_size, cfg)
    return dict(counted.sent), result["n_params"]


def test_the_rebuilt_ring_carries_the_gradient_all_reduce():
    # Ring all-reduce sends 2(n-1)/n of the message per rank (Patarasuk & Yuan 2009): on 2 ranks,
    # the gradient bytes once per step, plus a few bytes for the loss.
    from refimpl import launch

    cfg = LabConfig(strategy="dp", nproc=2, steps=3, collectives="refimpl")
    per_rank = launch.run(_train_counting, 2, cfg, timeout=600, quiet=True)
    for sent, n_params in per_rank:
        grad_bytes = 4 * n_params
        assert 3 * grad_bytes <= sent["all_reduce"] <= 3 * grad_bytes + 1024, sent
