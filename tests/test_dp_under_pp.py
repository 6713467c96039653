"""Data parallelism under a pipeline, the layouts that used to be refused before launch:

* the bucketed, overlapped `dp` (our DDP) on dp2 x pp2: each stage's buckets are all-reduced as
  the last backward (or W) of their parameters finishes, under 1F1B and the split schedules
  (zbv, zb-h1, interleaved, interleaved-zb, dualpipev), equal to `single` in float64; and the
  overlap is real, read off the trace's labels (the order of the ranges, never a duration): a
  bucket's all-reduce is issued while the rank still has backward work in the step -- inside the
  last B, before the gradients of the stage's earlier layers (1F1B), or in an action before the
  rank's last one (zbv: the V's second chunk finishes its W's first);
* zero3 and fsdp under the split schedules: a W after the last B of a unit delivers its weight
  gradients through autograd's accumulator, so they reach the unit's reduce-scatter; equal to
  `single` in float64 (zb-h1 in make test; zbv, dualpipev, interleaved-zb and REFIMPL_P2P_TAGS=one,
  NCCL's pairing by posting order, behind the `full` marker);
* dp2 x tp2 x pp2 under `dp` (interleaved, sequence parallel: `full`); tp x pp under the split
  schedules is tests/test_composition.py's (W reads tp's linears through `watch_matmul`).
"""
import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.trace.profiling import load_trace
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single
from refimpl.model import build_model, lm_loss, synthetic_batch
from refimpl.parallel.dp.flat_param import FlatParams
from refimpl.parallel.dp.grad_buckets import GradBuckets
from refimpl.parallel.pp.schedules import schedule_table
from refimpl.parallel.pp.stage import PipelineStageModel, build_chunks
from refimpl.parallel.pp.zero_bubble import WeightGradRecord, record_weight_grads
from tests.models import SMALL

ranks = pytest.mark.ranks   # launches rank processes (make test-fast skips those marked)

WORK = Path(tempfile.mkdtemp(prefix="refimpl-dp-under-pp-"))   # the traces
atexit.register(shutil.rmtree, WORK, ignore_errors=True)
TINY_BUCKETS = {"bucket_mb": 0.01}    # ~10 KiB: several buckets per stage (DDP's default is 25 MiB)


def layout(strategy, m=4, nproc=4, **kw):
    return LabConfig(strategy=strategy, nproc=nproc, pp=2, steps=2, global_batch=8, micro_batches=m,
                     return_state=True, dtype="float64", model=SMALL, **kw)


def traced(name, **kw):
    return layout("dp", options=TINY_BUCKETS, profile=True, trace_dir=str(WORK / name), **kw)


RUNS = {   # make test: one launch
    "dp 1f1b": traced("1f1b"),
    "dp zbv": traced("zbv", schedule="zbv"),
    "zero3 zb-h1": layout("zero3", schedule="zb-h1"),
}
FULL = {   # make test-full: one more launch
    "dp zb-h1": layout("dp", schedule="zb-h1", options=TINY_BUCKETS),
    "dp interleaved v2": layout("dp", schedule="interleaved", virtual_stages=2, options=TINY_BUCKETS),
    "dp interleaved-zb v2": layout("dp", schedule="interleaved-zb", virtual_stages=2,
                                   options=TINY_BUCKETS),
    "dp dualpipev": layout("dp", schedule="dualpipev", options=TINY_BUCKETS),
    "fsdp zb-h1": layout("fsdp", schedule="zb-h1"),
    "fsdp grad_op zb-h1": layout("fsdp", schedule="zb-h1", options={"sharding": "grad_op"}),
    "zero3 zbv": layout("zero3", schedule="zbv"),
    "fsdp dualpipev": layout("fsdp", schedule="dualpipev"),
    "zero3 interleaved-zb v2": layout("zero3", schedule="interleaved-zb", virtual_stages=2),
}
ONE_TAG = {   # make test-full: under REFIMPL_P2P_TAGS=one (tests/test_nccl_rules.py)
    "dp zbv, one tag": layout("dp", schedule="zbv", options=TINY_BUCKETS),
    "zero3 zb-h1, one tag": layout("zero3", schedule="zb-h1"),
    "fsdp zbv, one tag": layout("fsdp", schedule="zbv"),
}
EIGHT = {   # make test-full: dp2 x tp2 x pp2, the one 8-rank launch
    "dp dp2 x tp2 x pp2 interleaved v2 +sp": layout("dp", nproc=8, tp=2, schedule="interleaved",
                                                    virtual_stages=2, sequence_parallel=True,
                                                    options=TINY_BUCKETS),
}
GROUPS = {"make test": RUNS, "full": FULL, "one tag": ONE_TAG, "8 ranks": EIGHT}


@functools.lru_cache(maxsize=None)
def results(group):
    runs, saved = GROUPS[group], os.environ.get("REFIMPL_P2P_TAGS")
    if group == "one tag":
        os.environ["REFIMPL_P2P_TAGS"] = "one"      # the ranks inherit it (the zygote restarts)
    try:
        return dict(zip(runs, train_several_on_ranks(list(runs.values()), timeout=600)))
    finally:
        os.environ.pop("REFIMPL_P2P_TAGS", None)
        if saved is not None:
            os.environ["REFIMPL_P2P_TAGS"] = saved


def assert_equals_single(group, name):
    eq = compare_with_single(GROUPS[group][name], results(group)[name])
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, (eq.loss_rel_err, eq.weight_rel_err)


@ranks
@pytest.mark.parametrize("name", list(RUNS))
def test_dp_flavours_under_a_pipeline_equal_single(name):
    assert_equals_single("make test", name)


@ranks
@pytest.mark.full
@pytest.mark.parametrize("group,name", [(g, n) for g in ("full", "one tag", "8 ranks") for n in GROUPS[g]])
def test_every_schedule_with_dp_zero3_fsdp_equals_single(group, name):
    assert_equals_single(group, name)


def bucket_launches(name):
    """Per rank, in the last step: the backward actions (pp:B*, pp:W*) in order, and for each
    all-reduce issued inside one of them, the index of that action. The ranges' order is all
    that is read: an all-reduce range starts inside an action's range."""
    df = load_trace(results("make test")[name]["trace_dir"], include_ops=True)
    out = {}
    for rank, d in df[df.step == df.step.max()].groupby("rank"):
        actions = d[d.name.str.match(r"^pp:[BW]\d+(\.\d+)?$")].sort_values("start_us")
        spans = list(zip(actions.start_us, actions.start_us + actions.dur_us))
        launches = []
        for start in d[d.name.str.startswith("comm:all_reduce")].sort_values("start_us").start_us:
            inside = [i for i, (a, b) in enumerate(spans) if a <= start <= b]
            if inside:
                launches.append(inside[-1])
        out[rank] = (list(actions.name), launches)
    return out


@ranks
def test_dp_buckets_leave_while_the_pipeline_still_runs_its_backwards():
    for rank, (actions, launches) in bucket_launches("dp 1f1b").items():
        # One chunk per rank: every gradient is final only in the last B, so every bucket leaves
        # there, the first while autograd still computes the gradients of the rest (DDP's overlap).
        assert len(launches) > 2 and set(launches) == {len(actions) - 1}, (rank, actions, launches)
    for rank, (actions, launches) in bucket_launches("dp zbv").items():
        # The V: chunk 1's W's end before chunk 0's, so its buckets leave before the last action.
        assert actions[-1].endswith(".0") and min(launches) < len(actions) - 1, (rank, actions, launches)
        # The action that finishes chunk 1's last weight gradients: its last W, or the B before
        # that W when the two ran as one whole backward (lab.pipeline.speedups.whole_backwards: W then is empty).
        first = min(launches)
        finishing = actions[first] if actions[first].startswith("pp:W") else actions[first + 1]
        assert finishing == "pp:W" + actions[first][4:] and finishing.endswith(".1"), (rank, actions, first)



# --- the pieces, without ranks -----------------------------------------------------------------


def test_a_bucket_waits_for_the_last_accumulation_of_its_parameters():
    """Two parameters, a bucket each; the first is accumulated twice in the step, the second once:
    the second's bucket leaves at once, the first's only at its second accumulation."""
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    layout = FlatParams([("a", a), ("b", b)], world_size=1)
    launched = []

    def reduce(bucket, grads):
        launched.append(bucket.params)
        return torch.futures.Future()              # never waited on here

    buckets = GradBuckets(layout, cap_bytes=1, reduce=reduce)
    buckets.attach(layout.empty())
    with buckets.micro_step(True, accumulations=[2, 1]):
        torch.autograd.backward([a], [torch.ones(3)])
        assert launched == []                      # bucket 0 (b, the last parameter) goes first
        torch.autograd.backward([b], [torch.ones(3)])
        assert launched == [[1]]
        torch.autograd.backward([a], [torch.ones(3)])
        assert launched == [[1], [0]]
    assert a.grad.tolist() == [2.0] * 3


def test_w_hands_each_weight_gradient_to_autograd_once_last_layer_first():
    model = build_model(SMALL, 0)
    (chunk,) = build_chunks(model, 1, 0)
    mb = synthetic_batch(SMALL, 2, SMALL.seq_len, 0, 0)
    names = {p: n for n, p in chunk.named_parameters()}
    order = []
    for p in chunk.parameters():
        p.register_post_accumulate_grad_hook(lambda q: order.append(names[q]))
    record = WeightGradRecord()
    with record_weight_grads(chunk, record) as embeds:
        loss = lm_loss(chunk(mb.inputs), mb.targets)
    for (entry, _), g in zip(embeds, torch.autograd.grad(loss, [o for _, o in embeds])):   # B
        entry[2] = g
    assert order == []
    record.apply()                                                                          # W
    assert sorted(order) == sorted(names.values())          # every parameter, once
    assert order[0].startswith("lm_head") and order[-1].startswith("embed")


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2),
                                        ("dualpipev", 2)])
def test_each_parameter_is_accumulated_once_per_micro_batch_of_its_chunk(schedule, v):
    """Read off the table row (B's, or W's under a split schedule; dualpipev's F&B pairs split):
    every chunk runs every micro-batch's backward once, so m accumulations each."""
    m = 4 if schedule != "dualpipev" else 8
    table = schedule_table(2, m, schedule, v)
    chunks = build_chunks(build_model(SMALL, 0), 2, 0, v, where="v" if v == 2 and schedule != "interleaved"
                          else "loop")
    counts = PipelineStageModel(chunks, table, 0, None, schedule, loss_stage=1).gradient_accumulations()
    assert sorted(counts) == sorted(n for c in chunks for n, _ in c.named_parameters())
    assert set(counts.values()) == {m}
