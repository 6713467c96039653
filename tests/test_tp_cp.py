"""Ring attention over tensor-parallel heads (refimpl.compose.tp_cp): tp x cp equals `single`.

Each tp rank holds a/tp heads of Q, K and V and rings its K/V shard among its cp peers; the
losses and the final weights (gathered from the tp shards) equal single's at float64's gate.

  make test   cp2 x tp2 x pp2 with --sequence-parallel under 1F1B (8 ranks, 2 blocks, 2 steps)
              is tests/test_composition.py's, in its one 8-rank launch (start-up paid once);
              tp2 x cp2 with --sequence-parallel under zero1 (4 ranks) is tests/test_nccl_rules.py's
              run, which equals single with every message paired by posting order alone (NCCL's
              rule) and audits each rank's tensors for their device; on fake tensors (no ranks,
              tests/test_dryrun.py), a ring message under tp x cp is 1/tp of plain cp's
  full        those two runs here too, tp2 x cp2 without SP and with activation
              checkpointing; dp2 x tp2 x cp2 under zero2 and fsdp (8 ranks); cp2 x tp2 x pp2
              interleaved (8 ranks)
"""
import functools

import pytest

from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig
from refimpl.train import validate
from tests.models import SMALL

TWO_BLOCKS = GPTConfig(**{**SMALL.to_dict(), "n_layers": 2})   # one block per pipeline stage


def layout(strategy, world, model=SMALL, **kw):
    kw.setdefault("micro_batches", 2)
    return LabConfig(strategy=strategy, nproc=world, steps=2, global_batch=8, return_state=True,
                     dtype="float64", model=model, **kw)


RUNS = {  # (world, in make test?) -> name -> config
    (4, False): {"zero1 tp2 x cp2 +sp": layout("zero1", 4, tp=2, cp=2, sequence_parallel=True),
                 "tp tp2 x cp2": layout("tp", 4, tp=2, cp=2, micro_batches=1),
                 "fsdp tp2 x cp2 +ckpt": layout("fsdp", 4, tp=2, cp=2,
                                                activation_checkpointing=True)},
    (8, False): {"pp-1f1b cp2 x tp2 x pp2 +sp": layout("pp-1f1b", 8, TWO_BLOCKS, tp=2, cp=2, pp=2,
                                                       sequence_parallel=True),
                 "zero2 dp2 x tp2 x cp2": layout("zero2", 8, tp=2, cp=2),
                 "fsdp dp2 x tp2 x cp2 +sp": layout("fsdp", 8, tp=2, cp=2, sequence_parallel=True),
                 "zero1 cp2 x tp2 x pp2 interleaved v2": layout(
                     "zero1", 8, tp=2, cp=2, pp=2, schedule="interleaved", virtual_stages=2,
                     micro_batches=4)},
}
CASES = [pytest.param(world, name, marks=[pytest.mark.ranks] + ([] if fast else [pytest.mark.full]))
         for (world, fast), runs in RUNS.items() for name in runs]


@functools.lru_cache(maxsize=None)
def results(world, fast):
    names = list(RUNS[world, fast])
    return dict(zip(names, train_several_on_ranks([RUNS[world, fast][n] for n in names],
                                                  timeout=600)))


@pytest.mark.parametrize("world,name", CASES)
def test_tp_x_cp_equals_single(world, name):
    fast = name in RUNS.get((world, True), {})
    config, result = RUNS[world, fast][name], results(world, fast)[name]
    eq = compare_with_single(config, result)
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, (eq.loss_rel_err, eq.weight_rel_err)
    assert len({tuple(r["losses"]) for r in result["per_rank"]}) == 1   # one loss on every rank


def test_sequence_parallel_over_cp_needs_the_cp_slice_to_split_over_tp():
    """Under cp a rank holds s/cp tokens, and those are what SP cuts over tp: s = 24 on cp 2
    leaves 12 tokens, which tp 8 cannot split (while s itself, 24, is what the plain tp check reads)."""
    model = GPTConfig(**{**SMALL.to_dict(), "n_heads": 8})
    with pytest.raises(LayoutError, match="s/cp = 12 tokens .* divisible by --tp 8"):
        validate(LabConfig(strategy="tp", nproc=16, tp=8, cp=2, seq_len=24,
                           sequence_parallel=True, model=model))
    validate(LabConfig(strategy="tp", nproc=16, tp=8, cp=2, seq_len=24, model=model))   # no SP
