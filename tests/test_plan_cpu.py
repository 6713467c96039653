"""The planner checked on this machine: every layout the loop runs on 4 CPU ranks (each grid of
dp x tp x pp x cp, each ZeRO stage, with and without activation checkpointing and sequence
parallelism) is predicted by refimpl.lab.plan and then run, and the predicted memory per rank must
match the measured one (the loop counts the tensors a rank holds and the activations it saves).
Here one layout per grid with activation checkpointing (notebook 09: one per grid without);
make test-full measures all 66.

Memory is deterministic, so it is asserted here. Step time is wall time: the same table with
measured step times is scripts/bench_plan_cpu.py's (never a test); its model's parts that do not
depend on the clock are checked below on fixed inputs.
"""
import pytest

from refimpl.lab.measure.this_machine import cpu_preset
from refimpl.lab.plan.cpu import (
    cpu_layouts,
    layout_name,
    measure_cpu_layouts,
    one_layout_per_grid,
    ranking_agreement,
    sp_grad_sync_s,
    stage_tensors,
    time_sliced_step,
)
from refimpl.lab.plan.predict import Layout
from refimpl.model import GPTConfig

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

# Any rates: memory does not depend on them (measured ones are the benchmark's business).
HW = cpu_preset(5e10, 8e-4, 1e9, 1e10, block_overhead_s=4e-4)
MEMORY_ERROR = 0.15     # each layout's predicted bytes within 15% of the measured ones
MEMORY_MARGIN = 0.20    # layouts whose measured memory differs by more than 20% keep their order


@pytest.fixture(scope="module", params=["one per grid", pytest.param("all", marks=pytest.mark.full)])
def measured(request):
    # make test: one layout per grid with activation checkpointing (notebook 09 checks one per
    # grid without); make test-full: all 66, with and without (each costs ~1 s of set-up)
    if request.param == "all":
        return measure_cpu_layouts(cpu_layouts(HW, world_size=4), world_size=4, steps=1)
    table = one_layout_per_grid(cpu_layouts(HW, world_size=4, recompute=("full",)))
    return measure_cpu_layouts(table, world_size=4, steps=1)


def test_every_runnable_layout_is_in_the_table(measured):
    grids = set(zip(measured.dp, measured.tp, measured.pp, measured.cp))
    # every way to lay 4 ranks on the four axes, except tp x cp (refimpl.lab.plan.cpu.runs_here)
    assert grids == {(4, 1, 1, 1), (1, 4, 1, 1), (1, 1, 4, 1), (1, 1, 1, 4), (2, 2, 1, 1),
                     (2, 1, 2, 1), (2, 1, 1, 2), (1, 2, 2, 1), (1, 1, 2, 2)}
    assert set(measured.zero_stage) == {0, 1, 2, 3} and "full" in set(measured.recompute)
    assert measured.sequence_parallel.any()
    assert len(measured) == len({layout_name(r) for _, r in measured.iterrows()})


def test_predicted_memory_matches_measured(measured):
    agreement = ranking_agreement(measured.memory_bytes, measured.measured_memory_bytes,
                                  margin=MEMORY_MARGIN)
    rel = (measured.memory_bytes / measured.measured_memory_bytes - 1).abs()
    worst = measured.assign(rel=rel).sort_values("rel").tail(5)
    report = worst[["dp", "tp", "pp", "cp", "zero_stage", "recompute", "sequence_parallel",
                    "memory_bytes", "measured_memory_bytes", "rel"]].to_string()
    assert rel.max() <= MEMORY_ERROR, report
    assert agreement["spearman"] >= 0.95, agreement
    assert agreement["misordered"] == [], [
        (layout_name(measured.loc[a]), layout_name(measured.loc[b])) for a, b in agreement["misordered"]]
    # the extremes: the planner's smallest layout is the measured smallest, and its largest the
    # largest, up to the margin (two layouts a few % apart may swap, as in the ranking above)
    got = measured.measured_memory_bytes
    assert got[measured.memory_bytes.idxmin()] <= (1 + MEMORY_MARGIN) * got.min()
    assert got[measured.memory_bytes.idxmax()] >= got.max() / (1 + MEMORY_MARGIN)


def test_ranking_agreement_counts_only_pairs_beyond_the_margin():
    import pandas as pd

    measured = pd.Series([1.00, 1.05, 2.00, 4.00])
    predicted = pd.Series([1.10, 1.00, 2.50, 3.00])    # swaps the first two (5% apart) only
    assert ranking_agreement(predicted, measured, margin=0.10)["misordered"] == []
    assert ranking_agreement(predicted, measured, margin=0.0)["misordered"] == [(0, 1)]
    reversed_ = ranking_agreement(measured[::-1].reset_index(drop=True), measured, margin=0.5)
    assert reversed_["spearman"] == pytest.approx(-1.0) and len(reversed_["misordered"]) == 5
    assert not reversed_["same_fastest"] and ranking_agreement(predicted, measured)["same_fastest"] is False


def test_time_slicing_makes_bubbles_cheaper_and_full_pipelines_dearer():
    # 4 stages, 4 micro-batches of 10 ms each, no communication or optimizer
    row = {"micro_batches": 4, "pp": 4, "compute_s": 0.040, "optimizer_s": 0.0, "tp_comm_s": 0.0,
           "cp_comm_s": 0.0, "pp_comm_s": 0.0, "dp_comm_s": 0.0}
    own_core = time_sliced_step(row, world_size=4, cores=4)
    assert own_core["step_time_s"] == pytest.approx(0.070)   # (m + p - 1) x 10 ms: 1F1B's bubble
    shared = time_sliced_step(row, world_size=4, cores=2)
    assert shared["step_time_s"] == pytest.approx(0.080)     # 16 passes on 2 cores, not 2 x 70 ms
    flat = dict(row, pp=1)                                    # data parallel: every rank always busy
    assert time_sliced_step(flat, 4, 2)["step_time_s"] == pytest.approx(2 * time_sliced_step(flat, 4, 4)["step_time_s"])


def test_cores_are_shared_by_the_stages_mean_work_and_the_fit_keeps_its_terms_apart():
    from refimpl.lab.plan.cpu import mean_stage_compute_s
    from refimpl.lab.plan.cpu_calibration import nonnegative_least_squares, shape_of

    # 4 stages: the busiest holds a block and the head, the mean a quarter of the whole model
    shape = shape_of(GPTConfig(), 32)
    whole = mean_stage_compute_s(shape, Layout(micro_batch_size=2), HW, 4)
    staged = mean_stage_compute_s(shape, Layout(pp=4, micro_batch_size=2), HW, 4)
    assert staged == pytest.approx(whole / 4)
    row = {"micro_batches": 4, "pp": 4, "compute_s": 0.040, "optimizer_s": 0.0, "tp_comm_s": 0.0,
           "cp_comm_s": 0.0, "pp_comm_s": 0.0, "dp_comm_s": 0.0, "step_overhead_s": 0.0}
    busiest = time_sliced_step(row, world_size=4, cores=1)["step_time_s"]
    assert time_sliced_step(dict(row, mean_compute_s=0.030), 4, 1)["step_time_s"] == pytest.approx(0.75 * busiest)
    # the calibration's fit: rate, per-pass and per-step costs, each recovered, none below zero
    import numpy as np
    a = np.array([[1.0, 15, 1], [2, 15, 1], [4, 15, 1], [4, 30, 1], [4, 60, 1]])
    assert nonnegative_least_squares(a, a @ [0.5, 0.01, 0.2]) == pytest.approx([0.5, 0.01, 0.2])
    assert nonnegative_least_squares(a, a @ [0.5, 0.01, 0.0] - 0.05)[2] == 0.0


def test_per_tensor_messages_are_counted():
    from refimpl.model import GPT

    cfg = GPTConfig()
    model = GPT(cfg)
    count = lambda module: len(list(module.parameters()))   # noqa: E731
    # dp-naive all-reduces each parameter tensor: the whole model's without a pipeline, and the
    # last stage's (its blocks, the final norm, the head) with one
    assert stage_tensors(cfg, 1) == count(model)
    assert stage_tensors(cfg, 2) == count(model) - count(model.embed) - 2 * count(model.blocks[0])
    per_micro_batch = sp_grad_sync_s(cfg, Layout(tp=2, sequence_parallel=True), HW, 1)
    assert sp_grad_sync_s(cfg, Layout(tp=2), HW, 1) == 0.0
    assert sp_grad_sync_s(cfg, Layout(tp=2, sequence_parallel=True), HW, 4) == pytest.approx(4 * per_micro_batch)
    alpha, _ = HW.link(True)
    assert per_micro_batch >= (6 * cfg.n_layers + 2) * 2 * alpha   # 26 all-reduces of 2 ring steps


def test_moving_bytes_is_core_work_and_latency_is_not():
    # 2 ranks' worth of work on 1 core: 10 ms of compute and 4 ms of collectives, 1 ms of it latency
    row = {"micro_batches": 1, "pp": 1, "compute_s": 0.010, "optimizer_s": 0.0, "tp_comm_s": 0.0,
           "cp_comm_s": 0.0, "pp_comm_s": 0.0, "dp_comm_s": 0.004}
    step = time_sliced_step(row, world_size=2, cores=1, waiting_s=0.001)
    assert step["step_time_s"] == pytest.approx(2 * (0.010 + 0.003) + 0.001)
    assert time_sliced_step(row, 2, 2, waiting_s=0.001)["step_time_s"] == pytest.approx(0.014)
