"""Profiling: one trace per rank, labelled ranges found again, and the time split computed right."""
import pandas as pd
import pytest

from refimpl.lab.trace.profiling import comm_table, load_trace, summarize
from refimpl.launch import run


def _profiled_all_reduce(rank, world_size, out_dir, steps):
    import torch
    import torch.distributed as dist

    from refimpl.lab.instrument.labels import comm_span, phase
    from refimpl.lab.trace.capture import StepProfiler

    x = torch.randn(256, 256)
    with StepProfiler(out_dir, rank, steps) as prof:
        for _ in range(steps):
            with phase("forward"):
                y = x @ x
            with comm_span("all_reduce", y.numel() * y.element_size()):
                dist.all_reduce(y)
            prof.step()
    return y.sum().item()


@pytest.mark.ranks
def test_two_ranks_write_one_trace_each_and_the_loader_finds_the_communication(tmp_path):
    run(_profiled_all_reduce, 2, str(tmp_path), 4, quiet=True)
    assert sorted(p.name.split(".")[0] for p in tmp_path.glob("*.pt.trace.json")) == ["rank0", "rank1"]
    df = load_trace(tmp_path)
    assert set(df["rank"]) == {0, 1}
    comm = df[df.name.str.startswith("comm:")]
    # warm-up step 0 is not recorded: steps 1..3 on each rank
    assert sorted(comm.groupby("rank").size()) == [3, 3]
    assert set(comm.op) == {"all_reduce"} and set(comm.bytes) == {256 * 256 * 4}
    table = comm_table(df)
    assert list(table["count"]) == [3, 3] and (table["GB_per_s"] > 0).all()
    summary = summarize(df)
    assert list(summary["steps"]) == [3, 3]
    assert ((summary.compute_us > 0) & (summary.comm_us > 0)).all()
    fractions = summary[["compute_frac", "comm_frac", "overlap_frac", "idle_frac"]].sum(axis=1)
    assert ((fractions - 1).abs() < 1e-9).all()


def _frame(rows):
    return pd.DataFrame(rows, columns=["rank", "name", "category", "start_us", "dur_us", "thread",
                                       "step"])


def test_time_split_counts_overlap_only_on_another_thread():
    # One 100 µs step: forward 0-60 on the main thread, with a comm 20-40 on a background thread
    # (hidden under compute), then a blocking comm 70-90 on the main thread (exposed), idle 90-100.
    df = _frame([
        (0, "ProfilerStep#1", "step", 0, 100, 1, 1),
        (0, "forward", "forward", 0, 60, 1, 1),
        (0, "comm:all_reduce", "comm", 20, 20, 2, 1),
        (0, "backward", "backward", 60, 30, 1, 1),
        (0, "comm:all_gather", "comm", 70, 20, 1, 1),
    ])
    s = summarize(df).iloc[0]
    assert (s.compute_us, s.overlap_us, s.comm_us, s.idle_us) == (50, 20, 20, 10)
    assert s.comm_hidden_frac == 0.5


def test_a_backend_range_on_the_compute_thread_is_in_flight_not_a_call():
    # The staged backend records gloo:<op> on the caller's thread, from the call until the
    # collective completes (refimpl.lab.runtime.shared_device): that is communication hidden under the
    # forward, where a comm: label there is the thread inside a call, not computing.
    rows = [(0, "ProfilerStep#1", "step", 0, 100, 1, 1), (0, "forward", "forward", 0, 100, 1, 1)]
    in_flight = summarize(_frame(rows + [(0, "gloo:all_reduce", "comm", 20, 30, 1, 1)])).iloc[0]
    in_a_call = summarize(_frame(rows + [(0, "comm:all_reduce", "comm", 20, 30, 1, 1)])).iloc[0]
    assert (in_flight.compute_us, in_flight.overlap_us, in_flight.comm_us) == (70, 30, 0)
    assert (in_a_call.compute_us, in_a_call.overlap_us, in_a_call.comm_us) == (70, 0, 30)
