"""The layout matrix's resume pass (refimpl.lab.verify.resume_matrix): a layout resumed from a checkpoint
another layout wrote equals single's uninterrupted run (float64: losses and every weight at 1e-9).

make test: three pairs, one kind of sharding each way in two launches: ZeRO-3's and FSDP's flat
shards on 3 ranks (uneven: the last rank's shard is padded) read as tp + SP slices, as pipeline
stages under zero-bubble's V schedule, and as ZeRO-2's shards over context parallelism's ranks.
make test-full runs every layout of the whole pairwise cover through the pass
(tests/test_layout_matrix.py).
"""
from __future__ import annotations

import pytest

from refimpl.lab.verify import layout_matrix as lm
from refimpl.lab.verify.matrix_run import counts
from refimpl.lab.verify.resume_matrix import WRITTEN_AT, resumable, resume_pairs, run_resumed

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)


def test_flat_shards_on_3_ranks_resume_as_tp_sp_pipeline_and_cp_layouts():
    pairs = [(lm.layout_of(world=3, strategy="zero3"),
              lm.layout_of(world=2, strategy="dp-naive", tp=2, sequence_parallel=True)),
             (lm.layout_of(world=3, strategy="fsdp"),
              lm.layout_of(world=2, strategy="dp-naive", pp=2, schedule="zbv", micro_batches=2)),
             (lm.layout_of(world=3, strategy="zero2"),
              lm.layout_of(world=2, strategy="zero1", cp=2))]
    outcomes = run_resumed(pairs)
    found = counts(outcomes)
    print(found)
    for o in outcomes:
        print(f"{o.label():50s} loss {o.loss_err:.1e} weights {o.weight_err:.1e}")
    assert found.ran == 3 and not found.wrong, str(found)
    # each reader read another layout's checkpoint: the pairing is what was asked
    assert [(o.written_by, o.layout) for o in outcomes] == pairs


def test_pairs_chain_each_group_of_one_model_and_format():
    """Each resumable layout writes once and reads once, from another layout where its group has
    one; a bf16 layout, or a layout that cannot checkpoint, is not paired."""
    gpt = [lm.layout_of(world=2, strategy="zero1"), lm.layout_of(world=3, strategy="fsdp"),
           lm.layout_of(world=4, strategy="dp", tp=2)]
    llama = [lm.layout_of(world=2, strategy="zero3", arch="llama")]
    twins = [lm.layout_of(world=2, strategy="torch-ddp"), lm.layout_of(world=3, strategy="torch-fsdp2")]
    left_out = [lm.layout_of(world=2, strategy="zero1", precision="bf16"),
                lm.layout_of(world=2, strategy="zero2", option=(("offload", True),))]
    assert not any(map(resumable, left_out))
    pairs = resume_pairs(gpt + left_out + llama + twins)
    assert pairs == [(gpt[0], gpt[1]), (gpt[1], gpt[2]), (gpt[2], gpt[0]), (llama[0], llama[0]),
                     (twins[0], twins[1]), (twins[1], twins[0])]
    assert WRITTEN_AT < lm.STEPS      # the reader trains at least one step after the checkpoint
