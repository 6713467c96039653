"""NCCL's matching rule, checked on gloo: every point-to-point message carries the same tag.

NCCL ignores tags and pairs the messages between two ranks in the order they were posted; gloo
pairs them by tag, so a posting order that NCCL would pair wrongly can pass here unseen. Under
REFIMPL_P2P_TAGS=one (refimpl.comm.p2p.wire_tag) every message is sent with tag 0 and gloo pairs
them by posting order, as NCCL does. Every pipeline schedule (interleaved, whose chunks talk to the
same neighbour in both directions, included), ring attention and the rebuilt collectives must then
still equal `single` at float64's gate; a wrong pairing would give another tensor (a weight error
far above 1e-9) or a hang (the launcher's timeout).
"""
import functools
import os

import pytest

from refimpl.config import TrainConfig
from refimpl.model import GPTConfig
from refimpl.train import train_several_on_ranks
from refimpl.verify.equivalence import FP64_TOLERANCE, compare_with_single
from tests.models import SMALL

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)


def cfg(strategy, world, m=2, *, layers=4, **kw):
    return TrainConfig(strategy=strategy, nproc=world, steps=2, global_batch=8, micro_batches=m,
                       return_state=True, dtype="float64",
                       model=GPTConfig(**{**SMALL.to_dict(), "n_layers": layers}), **kw)


RUNS = {
    2: {"pp-1f1b m4": cfg("pp-1f1b", 2, 4, pp=2),
        "pp-interleaved v2 m4": cfg("pp-interleaved", 2, 4, pp=2, virtual_stages=2),
        "pp-zb m4": cfg("pp-zb", 2, 4, pp=2),
        "ring attention cp2": cfg("dp-naive", 2, 1, cp=2),
        "zero2, rebuilt collectives": cfg("zero2", 2, collectives="refimpl")},
    4: {"zero1 dp2 x pp2, rebuilt collectives": cfg("zero1", 4, 2, pp=2, collectives="refimpl"),
        "pp2 x cp2": cfg("dp-naive", 4, 2, pp=2, cp=2)},
}


@functools.lru_cache(maxsize=None)
def results(world):
    names = list(RUNS[world])
    before = os.environ.get("REFIMPL_P2P_TAGS")
    os.environ["REFIMPL_P2P_TAGS"] = "one"      # the ranks inherit it (the zygote restarts)
    try:
        runs = train_several_on_ranks([RUNS[world][n] for n in names], timeout=300)
    finally:
        if before is None:
            del os.environ["REFIMPL_P2P_TAGS"]
        else:
            os.environ["REFIMPL_P2P_TAGS"] = before
    return dict(zip(names, runs))


@pytest.mark.parametrize("world,name", [(w, n) for w, runs in RUNS.items() for n in runs])
def test_posting_order_alone_pairs_every_message(world, name):
    eq = compare_with_single(RUNS[world][name], results(world)[name])
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, (eq.loss_rel_err, eq.weight_rel_err)
