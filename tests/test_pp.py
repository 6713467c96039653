"""The pipeline runner computes what one process computes: same loss, same gradients, any schedule.

One launch per world size runs every (schedule, micro-batches, virtual stages) case on the same
ranks; each case's loss (from the last stage) and gradients (every stage's, under the reference's
names) are compared with the whole model on the same micro-batches.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from refimpl.launch import run
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig, build_model, lm_loss, synthetic_batch
from refimpl.parallel.pp.links import Links
from refimpl.parallel.pp.runner import Backward, run_schedule, step_parts
from refimpl.parallel.pp.schedules import chunks_per_rank, placement, schedule_table, schedules
from refimpl.parallel.pp.stage import build_chunks, partition
from refimpl.parallel.pp.zero_bubble import WeightGradRecord, record_weight_grads
from refimpl.placement import mark_resharded

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

BATCH, SEQ, SEED = 12, 16, 3


def config(n_layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=64, seq_len=SEQ, d_model=32, n_heads=4, n_layers=n_layers)


# (schedule, m, v, n_layers) per world size; m < p for 1f1b and zb-h1 on 4 ranks; 3 ranks uneven.
CASES = {
    2: [("gpipe", 1, 1, 4), ("gpipe", 4, 1, 4), ("1f1b", 1, 1, 4), ("1f1b", 4, 1, 4),
        ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 4), ("zb-h1", 2, 1, 4), ("zb-h1", 4, 1, 4),
        ("interleaved-zb", 4, 2, 4), ("zbv", 2, 2, 4), ("zbv", 4, 2, 4), ("dualpipev", 4, 2, 4)],
    4: [("gpipe", 4, 1, 4), ("1f1b", 2, 1, 4), ("1f1b", 6, 1, 4), ("interleaved", 4, 2, 8),
        ("zb-h1", 3, 1, 4), ("zb-h1", 6, 1, 4), ("interleaved-zb", 4, 2, 8), ("zbv", 6, 2, 8),
        ("dualpipev", 12, 2, 8)],
    3: [("gpipe", 3, 1, 4), ("1f1b", 2, 1, 4), ("1f1b", 4, 1, 4), ("interleaved", 3, 2, 7),
        ("zb-h1", 4, 1, 4)],
}
# The same cases on the core's own Links and Backward ("core"): the default run takes the lab's
# faster ones (refimpl.lab.pipeline.speedups, the "refimpl.pipeline" plug-in).
CORE = "core"
CASES[2] += [(CORE, "1f1b", 4, 1, 4), (CORE, "interleaved", 4, 2, 4), (CORE, "zb-h1", 4, 1, 4),
             (CORE, "interleaved-zb", 4, 2, 4), (CORE, "zbv", 4, 2, 4), (CORE, "dualpipev", 4, 2, 4)]
CASES[4] += [(CORE, "zb-h1", 6, 1, 4), (CORE, "dualpipev", 12, 2, 8)]


def reference(m: int, n_layers: int):
    model = build_model(config(n_layers), SEED)
    total = 0.0
    for mb in synthetic_batch(config(n_layers), BATCH, SEQ, SEED, 0).micro_batches(m):
        loss = lm_loss(model(mb.inputs), mb.targets) / m
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in model.named_parameters()}


def pipeline_rank(rank, world, cases):
    group = dist.new_group(list(range(world)))
    out = {}
    for case in cases:
        core = case[0] == CORE
        schedule, m, v, n_layers = case[1:] if core else case
        where = placement(schedule)
        chunks = build_chunks(build_model(config(n_layers), SEED), world, rank, v, where=where)
        micro = synthetic_batch(config(n_layers), BATCH, SEQ, SEED, 0).micro_batches(m)
        table = schedule_table(world, m, schedule, v)
        parts = {"links": Links, "backward": Backward} if core else {}
        loss = run_schedule(chunks, table, micro, group, where=where, **parts)
        grads = {n: p.grad for c in chunks for n, p in c.named_parameters()}
        out[case] = (loss, grads)
    return out


@functools.lru_cache(maxsize=None)
def runs_on(world: int):
    return run(pipeline_rank, world, CASES[world], quiet=True)


def rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases])
def test_pipeline_matches_one_process(world, case):
    ranks = runs_on(world)
    losses = [r[case][0] for r in ranks]
    schedule, m, _, n_layers = case[1:] if case[0] == CORE else case
    last = 0 if placement(schedule) == "v" else world - 1     # the rank with the last piece: the V's is 0
    assert [loss is None for loss in losses] == [r != last for r in range(world)]
    ref_loss, ref_grads = reference(m, n_layers)
    assert abs(losses[last] - ref_loss) / ref_loss <= 1e-6
    grads = [r[case][1] for r in ranks]
    names = [n for g in grads for n in g]
    assert sorted(names) == sorted(ref_grads)               # every parameter on exactly one stage
    merged = {n: t for g in grads for n, t in g.items()}
    worst = max(rel_err(merged[n], ref_grads[n]) for n in ref_grads)
    assert worst <= 1e-5, worst
    if not schedules()[schedule].split:                     # same ops in the same order
        assert all(torch.equal(merged[n], ref_grads[n]) for n in ref_grads)


@pytest.mark.parametrize("core", [False, True], ids=["default", "core"])
@pytest.mark.parametrize("schedule", schedules())
def test_one_stage_with_two_chunks_passes_tensors_locally(schedule, core):
    v = 2 if schedule.startswith("interleaved") else chunks_per_rank(schedule)
    chunks = build_chunks(build_model(config(4), SEED), 1, 0, v, where=placement(schedule))
    micro = synthetic_batch(config(4), BATCH, SEQ, SEED, 0).micro_batches(2)
    parts = {"links": Links, "backward": Backward} if core else {}
    loss = run_schedule(chunks, schedule_table(1, 2, schedule, v), micro, None, where=placement(schedule),
                        **parts)
    ref_loss, ref_grads = reference(2, 4)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-6)
    for c in chunks:
        for n, p in c.named_parameters():
            assert rel_err(p.grad, ref_grads[n]) <= 1e-5


def test_the_runner_takes_the_lab_s_speedups_by_default():
    from refimpl.lab.pipeline.speedups import MergedBackward, PostedLinks

    assert step_parts() == (PostedLinks, MergedBackward)


def test_zero_bubble_b_leaves_weights_alone_and_w_finishes_them():
    model = build_model(config(2), SEED)
    (chunk,) = build_chunks(model, 1, 0)
    mb = synthetic_batch(config(2), BATCH, SEQ, SEED, 0)
    record = WeightGradRecord()
    with record_weight_grads(chunk, record) as embeds:
        loss = lm_loss(chunk(mb.inputs), mb.targets)
    grads = torch.autograd.grad(loss, [o for _, o in embeds])           # B
    for (entry, _), g in zip(embeds, grads):
        entry[2] = g
    assert all(p.grad is None for p in chunk.parameters())
    record.apply()                                                       # W
    _, ref_grads = reference(1, 2)
    for n, p in chunk.named_parameters():
        assert rel_err(p.grad, ref_grads[n]) <= 1e-5


def test_partition_is_as_even_as_whole_blocks_allow():
    assert [len(r) for r in partition(4, 3)] == [2, 1, 1]
    assert [list(r) for r in partition(7, 2)] == [[0, 1, 2, 3], [4, 5, 6]]
    with pytest.raises(LayoutError, match="at least as many"):
        partition(4, 5)
    with pytest.raises(LayoutError, match="at least as many"):
        build_chunks(build_model(config(4), SEED), 4, 0, virtual_stages=2)


def test_first_and_last_stage_own_embedding_and_head():
    chunks = [build_chunks(build_model(config(4), SEED), 3, s)[0] for s in range(3)]
    assert [c.embed is not None for c in chunks] == [True, False, False]
    assert [c.lm_head is not None for c in chunks] == [False, False, True]
    assert [list(c.blocks) for c in chunks] == [["0", "1"], ["2"], ["3"]]


def test_zero_bubble_b_skips_the_weight_products():
    # Counted, not timed: B (input gradient) must not also compute dW = X^T dY, or zero bubble
    # would defer nothing. B + W does the full backward's matrix products, B alone about half.
    from torch.utils.flop_counter import FlopCounterMode

    (chunk,) = build_chunks(build_model(config(2), SEED), 2, 1)   # block 1 + head: no embedding
    x0 = torch.randn(4, SEQ, 32)

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    x = x0.clone().requires_grad_()
    loss = chunk(x).square().mean()
    full = flops(loss.backward)
    record, x = WeightGradRecord(), x0.clone().requires_grad_()
    with record_weight_grads(chunk, record):
        out = chunk(x).square().mean()
    b = flops(lambda: torch.autograd.grad(out, [x]))
    w = flops(record.apply)
    assert b + w == full and 0.3 * full < b < 0.7 * full


@pytest.mark.parametrize("resharded", [False, True])
def test_first_piece_w_is_the_whole_backward_unless_a_parameter_is_resharded(resharded):
    # The first piece has no input gradient to send, so under the lab's speed-ups (MergedBackward)
    # its B does no matrix product and its W is the whole backward; a chunk holding a parameter
    # ZeRO-3/FSDP marked resharded keeps the core's split (B to the embedding's output, W the
    # formulas). Gradients equal the plain backward either way, and a parameter's hook fires once, in W.
    from torch.utils.flop_counter import FlopCounterMode

    from refimpl.lab.pipeline.speedups import MergedBackward
    from refimpl.parallel.pp.schedules import Action, parse_entry

    (chunk,) = build_chunks(build_model(config(2), SEED), 2, 0)   # embedding + block 0
    mb = synthetic_batch(config(2), BATCH, SEQ, SEED, 0)
    dy = torch.randn(BATCH, SEQ, 32, generator=torch.Generator().manual_seed(0))
    chunk(mb.inputs).backward(dy)
    want = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    chunk.zero_grad(set_to_none=True)
    calls = []
    chunk.blocks["0"].ln1.weight.register_hook(lambda g: calls.append(1))
    if resharded:
        mark_resharded(chunk.blocks["0"].ln1.weight)

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    with FlopCounterMode(display=False) as counter:
        chunk(mb.inputs).backward(dy)
    full = counter.get_total_flops() - flops(lambda: chunk(mb.inputs))
    chunk.zero_grad(set_to_none=True)
    calls.clear()
    split = MergedBackward([chunk], [parse_entry(e) for e in ["F0", "B0", "F1", "W0"]])  # W0 not at once
    with split.recording(Action("F", 0), chunk) as kept:
        out = chunk(mb.inputs)
    fb = flops(lambda: split.backward(Action("B", 0), out, dy, None, kept))
    assert calls == []
    fw = flops(lambda: split.weights(Action("W", 0)))
    assert fb + fw == full and (0 < fw < fb if resharded else fb == 0)
    assert len(calls) == 1                                       # the hook fired once, in W
    for n, p in chunk.named_parameters():
        assert rel_err(p.grad, want[n]) <= 1e-6
