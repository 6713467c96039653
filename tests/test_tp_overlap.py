"""`--set tp_overlap=true` (refimpl.lab.tensor): sequence parallelism's all-gather and
reduce-scatter decomposed over the ring under the matmuls. It must equal plain `tp` with SP in
float64 (GPT and Llama blocks, 2 and 3 ranks; 4 and one tag in make test-full), carry the same bytes
as the collectives it replaces, show each chunk's transfer around a neighbouring chunk's matmul in
the profiler's ranges, and be refused in one line where it cannot run.
"""
import functools
import os
from dataclasses import replace

import pytest

from refimpl import launch
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_states
from refimpl.mesh import LayoutError
from refimpl.train import validate
from tests.models import SMALL

pytestmark = pytest.mark.ranks   # launches rank processes

OVERLAP = {"tp_overlap": True}
SIX_HEADS = replace(SMALL, d_model=48, n_heads=6, n_layers=2)   # 3 ranks divide heads and width
LLAMA = replace(SMALL, arch="llama", n_kv_heads=2, n_layers=2)


def cfg(world, model, **kw):
    return LabConfig(strategy="tp", nproc=world, steps=2, return_state=True, dtype="float64",
                     model=model, sequence_parallel=True, global_batch=6 if world == 3 else 4,
                     seq_len=24 if world == 3 else 32).with_(**kw)


PAIRS = {2: {"gpt": SMALL, "llama": LLAMA}, 3: {"gpt, 6 heads": SIX_HEADS},
         4: {"gpt": SMALL}}


@functools.cache
def pairs_on(world, one_tag=False):
    names = list(PAIRS[world])
    cfgs = [c for n in names for c in (cfg(world, PAIRS[world][n]),
                                       cfg(world, PAIRS[world][n], options=OVERLAP))]
    saved = os.environ.get("REFIMPL_P2P_TAGS")
    if one_tag:
        os.environ["REFIMPL_P2P_TAGS"] = "one"     # gloo then pairs messages as NCCL does
    try:
        out = train_several_on_ranks(cfgs, timeout=600)
    finally:
        os.environ.pop("REFIMPL_P2P_TAGS", None)
        if saved is not None:
            os.environ["REFIMPL_P2P_TAGS"] = saved
    return {n: (out[2 * i], out[2 * i + 1]) for i, n in enumerate(names)}


def assert_equal(plain, overlapped):
    worst = max(abs(a - b) / abs(a) for a, b in zip(plain["losses"], overlapped["losses"]))
    assert worst <= FP64_TOLERANCE, (plain["losses"], overlapped["losses"])
    whole, _, _ = compare_states(overlapped["state_dict"], plain["state_dict"])
    assert whole <= FP64_TOLERANCE, whole


@pytest.mark.parametrize("world, name", [(2, "gpt"), (2, "llama"), (3, "gpt, 6 heads")])
def test_overlapped_equals_plain_sequence_parallel(world, name):
    assert_equal(*pairs_on(world)[name])


@pytest.mark.full
@pytest.mark.parametrize("one_tag", [False, True])
def test_overlapped_equals_plain_on_4_ranks(one_tag):
    assert_equal(*pairs_on(4, one_tag)["gpt"])


# --- one ParallelMLP on the ring: the CommLog's bytes and the profiler's ranges -----------------

def _mlp_ring(rank, world):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from refimpl.lab.instrument.labels import CommLog
    from refimpl.lab.tensor.overlap import decompose
    from refimpl.model.config import GPTConfig
    from refimpl.model.layers import MLP
    from refimpl.parallel.tp.blocks import ParallelMLP
    from refimpl.parallel.tp.mappings import split_sequence

    torch.manual_seed(0)
    mlp = MLP(GPTConfig(vocab_size=32, seq_len=4 * world, d_model=24, n_heads=2)).double()
    x = torch.randn(2, 4 * world, 24, dtype=torch.float64)
    out = {}
    for overlap in (False, True):
        layer = ParallelMLP.from_mlp(mlp, None, sequence_parallel=True)
        if overlap:
            decompose(layer)
        mine = split_sequence(x.clone().requires_grad_(), None)
        with CommLog() as log, profile(activities=[ProfilerActivity.CPU]) as prof:
            layer(mine).square().sum().backward()
        out[overlap] = {"calls": log.calls,
                        "ranges": [(e.name, e.time_range.start, e.time_range.end)
                                   for e in prof.events() if e.name.startswith("tp:ring")]}
    return out


@functools.cache
def mlp_ring_on(world):
    return launch.run(_mlp_ring, world, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_steps_carry_the_bytes_of_the_collectives_they_replace(world):
    for rank in mlp_ring_on(world):
        plain, ring = rank[False]["calls"], rank[True]["calls"]
        for op in ("all_gather", "reduce_scatter"):
            # SP's collective of an M-byte message sends (t-1)/t·M per rank; each of the ring's
            # t-1 steps sends one chunk, M/t
            full = [c["bytes"] for c in plain if c["op"] == op]
            steps = [c["bytes"] for c in ring if c["op"] == f"ring_{op}"]
            assert len(steps) == (world - 1) * len(full)
            assert sum(steps) == sum(full) * (world - 1) // world


@pytest.mark.parametrize("world", [2, 3])
def test_trace_shows_each_transfer_around_a_neighbouring_chunks_matmul(world):
    """AG: chunk j-1 arrives while chunk j is multiplied; RS: chunk j+1's running sum leaves while
    chunk j is multiplied. Read from the profiler's ranges: the matmul starts after the messages
    were posted and ends before they were waited for."""
    for rank in mlp_ring_on(world):
        ranges = rank[True]["ranges"]
        transfers = [r for r in ranges if r[0].endswith((" in", " out"))]
        matmuls = [r for r in ranges if " matmul " in r[0]]
        # per pass: one AG (column layer fwd, row layer bwd) and one RS (row fwd, column bwd)
        assert len(transfers) == 4 * (world - 1) and len(matmuls) == 4 * world
        for name, start, end in transfers:
            kind, p, chunk, way = name.split()[0], name.split()[1], int(name.split()[2][1:]), name.split()[3]
            inside = [m for m in matmuls if m[0].startswith(f"{kind} {p} matmul")
                      and start <= m[1] and m[2] <= end]
            assert len(inside) == 1, (name, inside)
            neighbour = (chunk + 1) % world if way == "in" else (chunk - 1) % world
            assert inside[0][0].endswith(f"c{neighbour}"), (name, inside)


@pytest.mark.parametrize("cfg_, words", [
    (LabConfig(strategy="tp", nproc=2, options=OVERLAP), "needs --sequence-parallel"),
    (LabConfig(strategy="dp-naive", nproc=4, tp=2, pp=2, sequence_parallel=True, options=OVERLAP),
     "--pp"),
    (LabConfig(strategy="tp", nproc=2, sequence_parallel=True, mixed_precision="bf16",
               options=OVERLAP), "--mixed-precision"),
    (LabConfig(strategy="torch-tp", nproc=2, sequence_parallel=True, options=OVERLAP),
     "no option"),
])
def test_tp_overlap_refused_in_one_line(cfg_, words):
    with pytest.raises(LayoutError) as err:
        validate(cfg_)
    assert words in str(err.value) and "\n" not in str(err.value)
