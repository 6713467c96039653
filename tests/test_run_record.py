"""What a profiled run leaves beside its traces: run_summary.json and TensorBoard scalars."""
from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from refimpl.lab.config import LabConfig
from refimpl.lab.trace.run_record import EVENT_SUFFIX, read_run_summary
from refimpl.model import GPTConfig
from refimpl.train import train_on_ranks
from tests.trace_runs import REAL_RUN, shared_logdir

CATEGORIES = ("params", "grads", "optimizer", "activations_peak", "total")


def scalars(run) -> dict[str, list]:
    """tag -> [(step, value)] from the run folder's event file(s), as TensorBoard reads them."""
    acc = EventAccumulator(str(run))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.ranks
def test_two_ranks_summary_and_scalars(tmp_path_factory):
    logdir, results = shared_logdir(tmp_path_factory)
    run = logdir / REAL_RUN

    summary = read_run_summary(run)
    assert summary["world_size"] == 2 and summary["strategy"] == "test-allreduce"
    assert summary["memory"] == [r["memory"] for r in results]
    assert summary["losses"] == results[0]["losses"]

    assert len(list(run.glob(f"events.out.tfevents.*{EVENT_SUFFIX}"))) == 1   # rank 0 writes
    tags = scalars(run)
    assert [s for s, _ in tags["loss"]] == [0, 1, 2, 3]
    assert [v for _, v in tags["loss"]] == pytest.approx(results[0]["losses"])
    assert [s for s, _ in tags["time/step_ms"]] == [0, 1, 2, 3]
    for rank in (0, 1):
        for cat in CATEGORIES:
            assert tags[f"memory/rank{rank}/{cat}"][-1][1] == results[rank]["memory"][cat]
        # Steps 1 to 3 were profiled (step 0 is the profiler's warm-up).
        fraction = tags[f"comm/fraction/rank{rank}"]
        exposed = tags[f"comm/exposed_fraction/rank{rank}"]
        assert [s for s, _ in fraction] == [1, 2, 3]
        assert all(0 < e <= f <= 1 for (_, f), (_, e) in zip(fraction, exposed))


def test_training_loop_records_a_profiled_run_and_a_rerun_replaces_it(tmp_path):
    cfg = LabConfig(strategy="single", steps=2, global_batch=2, seq_len=8, profile=True,
                    trace_dir=str(tmp_path / "single"),
                    model=GPTConfig(d_model=16, n_heads=2, n_layers=1))
    for _ in range(2):
        result = train_on_ranks(cfg)
    run = tmp_path / "single"
    assert read_run_summary(run)["memory"] == result["memory"]
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    tags = scalars(run)
    assert {"loss", "time/step_ms", "memory/rank0/params", "comm/fraction/rank0"} <= set(tags)
    assert [v for _, v in tags["comm/fraction/rank0"]] == [0.0]   # one rank: nothing to say
