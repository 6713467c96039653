"""PyTorch's composed twin on dp2 x tp2 x pp2 (refimpl.lab.twins.torch_fsdp2_tp with --pp): FSDP2
over dp, DTensor TP over tp, torch.distributed.pipelining over pp, in torchtitan's order, beside
our fsdp on the same grid. make test runs one of them (1F1B +sp, in tests/test_composition.py);
this file, all `full` (one 8-rank launch), the other schedules PyTorch's FSDP2 composes with and
ours against theirs step by step.
"""
import functools

import pytest

from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single
from tests.models import SMALL

pytestmark = [pytest.mark.ranks, pytest.mark.full]


def layout(strategy, **kw):
    kw.setdefault("micro_batches", 2)
    return LabConfig(strategy=strategy, nproc=8, tp=2, pp=2, steps=3, global_batch=8,
                     return_state=True, dtype="float64", model=SMALL, **kw)


RUNS = {"ours fsdp 1f1b": layout("fsdp"),
        "torch 1f1b": layout("torch-fsdp2-tp"),
        "torch gpipe +ckpt": layout("torch-fsdp2-tp", schedule="gpipe", activation_checkpointing=True),
        "torch interleaved v2": layout("torch-fsdp2-tp", schedule="interleaved", virtual_stages=2,
                                       micro_batches=4)}


@functools.lru_cache(maxsize=None)
def results():
    return dict(zip(RUNS, train_several_on_ranks(list(RUNS.values()), timeout=900)))


@pytest.mark.parametrize("name", list(RUNS))
def test_equals_single(name):
    eq = compare_with_single(RUNS[name], results()[name])
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, (eq.loss_rel_err, eq.weight_rel_err)


def test_theirs_and_ours_agree_step_by_step():
    """The same grid, schedule and data: the losses agree to float64 round-off (not bit for bit:
    PyTorch divides the gradients by m after the sum, we divide each loss before it), and so do
    the final weights."""
    from refimpl.lab.verify.equivalence import compare_states

    ours, theirs = results()["ours fsdp 1f1b"], results()["torch 1f1b"]
    assert max(abs(a - b) / b for a, b in zip(ours["losses"], theirs["losses"])) < 1e-12
    assert compare_states(ours["state_dict"], theirs["state_dict"])[0] < 1e-9
