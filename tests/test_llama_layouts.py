"""--arch llama (and Mixtral, with --experts) under the layouts refimpl's parallelisms give it:
each equal to `single` in float64 (every step's loss and every weight within 1e-9), one launch
per world size, PyTorch's DTensor TP twin (torch-tp, a Llama plan) among them; the one not built
(that plan with fewer key/value heads than tp ranks) is refused before launch in one line.
Context parallelism rotates each rank's tokens by their global positions. Tensor parallelism
splits grouped-query attention by key/value heads, or, with fewer of them than tp ranks, gives each rank the one its query heads read and sums
that head's gradient over the ranks sharing it (refimpl.parallel.tp.layers).

The case that needed a change: zero bubble's W (refimpl.parallel.pp.zero_bubble) had no formula
for RMSNorm's gain, so pp-zbv trained Llama with those gradients left at zero (its weights 6e-3
from single's after 2 steps) and nothing refused it; W now has the formula, and a chunk holding a
parameter W has no formula for is refused.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig
from refimpl.train import train_on_ranks, validate

pytestmark = pytest.mark.ranks

LLAMA = GPTConfig(arch="llama", vocab_size=128, d_model=64, n_heads=8, n_kv_heads=2, n_layers=4)
MIXTRAL = replace(LLAMA, n_experts=4, top_k=2, capacity_factor=2.0, balance="none")
MQA = replace(LLAMA, n_kv_heads=1)   # one key/value head: under tp each rank holds it, shared
BASE = LabConfig(strategy="single", nproc=1, steps=2, global_batch=12, seq_len=16,
                 dtype="float64", model=LLAMA, return_state=True)

# make test: the cases the layout matrix's cover does not hold (its llama has 2 key/value heads
# and no other): the zero-bubble regression, one key/value head shared over tp, Mixtral under cp.
# The rest, with 3 and 4 ranks, in make test-full (the matrix covers llama pairwise meanwhile).
ON_2 = [dict(strategy="pp-zbv", pp=2), dict(strategy="tp", tp=2, model=MQA),
        dict(strategy="fsdp", cp=2, model=MIXTRAL),
        dict(strategy="torch-tp", tp=2, sequence_parallel=True)]   # PyTorch's DTensor plan
ON_2_FULL = [dict(strategy="torch-tp", tp=2), dict(strategy="dp"), dict(strategy="zero3"), dict(strategy="fsdp"),
             dict(strategy="pp-1f1b", pp=2, micro_batches=2), dict(strategy="torch-fsdp2"),
             dict(strategy="tp", tp=2, sequence_parallel=True),
             dict(strategy="tp", tp=2, model=MIXTRAL), dict(strategy="zero1", cp=2),
             dict(strategy="ep", ep=2, model=MIXTRAL),
             dict(strategy="zero1", model=MIXTRAL, activation_checkpointing=True)]
ON_3 = [dict(strategy="zero2"), dict(strategy="fsdp", model=MIXTRAL)]


def _single(model):
    return train_on_ranks(replace(BASE, model=model))


@pytest.fixture(scope="module")
def singles():
    return {m: _single(m) for m in (LLAMA, MIXTRAL, MQA)}


@pytest.mark.parametrize("nproc, layouts", [
    (2, ON_2), pytest.param(2, ON_2_FULL, marks=pytest.mark.full),
    pytest.param(3, ON_3, marks=pytest.mark.full)], ids=["2 ranks", "2 ranks, more", "3 ranks"])
def test_llama_layouts_equal_single(nproc, layouts, singles):
    cfgs = [replace(BASE, nproc=nproc, **layout) for layout in layouts]
    for layout, cfg, out in zip(layouts, cfgs, train_several_on_ranks(cfgs, timeout=300)):
        ref = singles[cfg.model]
        loss = max(abs(a - b) for a, b in zip(out["losses"], ref["losses"]))
        weight = max(float((out["state_dict"][k] - v).abs().max())
                     for k, v in ref["state_dict"].items())
        assert loss <= 1e-9 and weight <= 1e-9, (layout, loss, weight)


@pytest.mark.parametrize("changes, says", [
    (dict(strategy="torch-tp", tp=2, model=MQA), "1 key/value heads do not split over tp = 2"),
    (dict(strategy="tp", tp=2, model=replace(LLAMA, n_kv_heads=3, n_heads=12, d_model=96)),
     "3 KV heads do not split over tp = 2"),
])
def test_layouts_not_built_for_llama_are_refused_before_launch(changes, says):
    with pytest.raises(LayoutError, match=says):
        validate(replace(BASE, nproc=2, **changes))


def test_zero_bubble_refuses_a_parameter_it_has_no_formula_for():
    from refimpl.parallel.pp.zero_bubble import WeightGradRecord, record_weight_grads

    class Scale(nn.Module):          # a learned gain W has no formula for
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.gain

    chunk = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"no weight-gradient formula for 1.gain \(Scale\)"):
        with record_weight_grads(chunk, WeightGradRecord()):
            pass


@pytest.mark.full
def test_llama_on_4_ranks_equals_single(singles):
    layouts = [dict(strategy="zero3", pp=2, schedule="zbv"), dict(strategy="ep", ep=4, model=MIXTRAL),
               dict(strategy="tp", tp=4),           # 2 key/value heads on 4 ranks: each on 2
               dict(strategy="zero3", cp=2, tp=2, sequence_parallel=True),
               dict(strategy="fsdp", cp=2, tp=2, model=MQA),
               dict(strategy="zero1", tp=2, pp=2, sequence_parallel=True, schedule="zbv"),
               dict(strategy="fsdp", pp=2, micro_batches=2, model=MIXTRAL)]
    test_llama_layouts_equal_single(4, layouts, singles)
