"""PyTorch's pipelining twin computes what ours does; a profiled run follows its table; activation
memory per stage is what the table's in-flight count predicts."""
import functools
import tempfile

import pytest
import torch
import torch.distributed as dist

from refimpl.lab.measure.pp_measure import (
    action_slots,
    measured_costs,
    predicted_activation_peak,
    profile_pipeline,
    simulated_bubble_from,
)
from refimpl.lab.trace.profiling import load_trace
from refimpl.lab.twins.torch_pp import TorchPipeline, check_torch_layout
from refimpl.launch import run
from refimpl.mesh import LayoutError
from refimpl.model import build_model, synthetic_batch
from refimpl.parallel.pp.schedules import schedule_table
from refimpl.parallel.pp.stage import build_chunks
from tests.test_pp import BATCH, SEED, SEQ, config, reference, rel_err

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

TWIN_CASES = [("gpipe", 2, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2), ("interleaved", 4, 2)]


def twin_rank(rank, world, cases):
    group = dist.new_group(list(range(world)))
    out = {}
    for schedule, m, v in cases:
        chunks = build_chunks(build_model(config(4), SEED), world, rank, v)
        loss = TorchPipeline(chunks, group, world, schedule, m).step(
            synthetic_batch(config(4), BATCH, SEQ, SEED, 0))
        out[(schedule, m, v)] = (loss, {n: p.grad for c in chunks for n, p in c.named_parameters()})
    return out


@functools.lru_cache(maxsize=None)
def twin_runs():
    return run(twin_rank, 2, TWIN_CASES, quiet=True)


@pytest.mark.parametrize("case", TWIN_CASES)
def test_torch_pipelining_matches_one_process(case):
    ranks = twin_runs()
    ref_loss, ref_grads = reference(case[1], 4)
    assert ranks[0][case][0] is None and abs(ranks[1][case][0] - ref_loss) <= 1e-6 * ref_loss
    merged = {n: g for r in ranks for n, g in r[case][1].items()}
    assert max(rel_err(merged[n], ref_grads[n]) for n in ref_grads) <= 1e-5


@pytest.mark.parametrize("args,why", [((4, 2, "1f1b"), ">= stages"), ((2, 3, "interleaved", 2), "multiple"),
                                      ((2, 4, "zb-h1"), "runs gpipe")])
def test_torch_constraints_are_layout_errors(args, why):
    with pytest.raises(LayoutError, match=why):
        check_torch_layout(*args)


MEASURED = [("gpipe", 4), ("1f1b", 4)]


@functools.lru_cache(maxsize=None)
def profiled(schedule, m):
    trace = tempfile.mkdtemp(prefix="refimpl-pp-")
    rows = run(profile_pipeline, 2, config(4), schedule, m, global_batch=BATCH, seq_len=SEQ,
               trace_dir=trace, seed=SEED, quiet=True)
    return rows, action_slots(load_trace(trace, include_ops=True))


@pytest.mark.parametrize("schedule,m", MEASURED)
def test_trace_shows_the_table_in_order_and_the_waits(schedule, m):
    _, slots = profiled(schedule, m)
    table = schedule_table(2, m, schedule)
    for (step, rank), g in slots.groupby(["step", "rank"]):
        assert list(g.sort_values("start")["action"]) == table[rank]
    for _, g in slots.groupby("step"):
        at = {(r.rank, r.action): r for r in g.itertuples()}
        for mb in range(m):   # stage 1 starts F only after stage 0's F ended; stage 0's B after stage 1's
            assert at[(1, f"F{mb}")].start >= at[(0, f"F{mb}")].end
            assert at[(0, f"B{mb}")].start >= at[(1, f"B{mb}")].end


def test_measured_costs_come_from_the_run_and_enter_the_replay():
    _, slots = profiled("1f1b", 4)
    costs = measured_costs(slots, 2, 4, "1f1b")
    assert costs["action_cost"] > 0 and costs["comm"] >= 0      # a gap between actions: never zero
    plain = simulated_bubble_from(slots, 2, 4, "1f1b")
    assert simulated_bubble_from(slots, 2, 4, "1f1b", costs=costs) > plain   # the gaps are idle time


@pytest.mark.parametrize("schedule,m", MEASURED)
def test_activation_peak_is_in_flight_times_one_micro_batch(schedule, m):
    rows, _ = profiled(schedule, m)
    for row in rows:
        predicted = predicted_activation_peak(schedule_table(2, m, schedule)[row["rank"]], row["per_micro_batch"])
        assert abs(row["activation_peak"] - predicted) <= 0.01 * predicted
    gpipe_first, one_f_one_b_first = profiled("gpipe", 4)[0][0], profiled("1f1b", 4)[0][0]
    assert gpipe_first["activation_peak"] > 1.9 * one_f_one_b_first["activation_peak"]  # 4 vs 2 held


def twin_under_autocast(rank, world, m):
    """The first step's loss of PyTorch's gpipe without and with the step runner's bf16 autocast,
    the dtypes its stage's Linear layers computed in, and ours (run_schedule) under the same bf16."""
    from refimpl.parallel.pp.runner import run_schedule

    group = dist.new_group(list(range(world)))
    micro = synthetic_batch(config(4), BATCH, SEQ, SEED, 0).micro_batches(m)
    bf16 = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    out = {}
    for name, autocast in (("fp32", None), ("bf16", bf16)):
        chunks = build_chunks(build_model(config(4), SEED), world, rank, 1)
        seen = set()
        for layer in (mod for c in chunks for mod in c.modules() if isinstance(mod, torch.nn.Linear)):
            layer.register_forward_hook(lambda mod, a, o: None if o.is_meta else seen.add(o.dtype))
        loss = TorchPipeline(chunks, group, world, "gpipe", m).forward_backward(micro, autocast=autocast)
        out[name] = (float(loss), seen)
    chunks = build_chunks(build_model(config(4), SEED), world, rank, 1)
    ours = run_schedule(chunks, schedule_table(world, m, "gpipe"), micro, group, autocast=bf16)
    out["ours bf16"] = None if ours is None else float(ours)
    return out


def test_the_twin_runs_under_the_step_runners_autocast():
    """--mixed-precision bf16 reaches PyTorch's stages: their matmuls compute in bf16, and the loss
    is ours under bf16 (the same forward, summed in another order), not fp32's."""
    ranks = run(twin_under_autocast, 2, 2, quiet=True)
    assert all(r["fp32"][1] == {torch.float32} and r["bf16"][1] == {torch.bfloat16} for r in ranks)
    (fp32, _), (bf16, _), ours = ranks[1]["fp32"], ranks[1]["bf16"], ranks[1]["ours bf16"]
    assert abs(bf16 - ours) <= 1e-9 * ours
    assert abs(bf16 - fp32) > 1e-7 * fp32, (bf16, fp32)
