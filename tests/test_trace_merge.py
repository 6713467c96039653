"""merge_traces: one Chrome-trace file, a process lane per rank, every rank on one clock."""
from __future__ import annotations

import json

from refimpl.lab.trace.merge import MERGED_NAME, merge_traces
from refimpl.lab.trace.profiling import load_trace, trace_files
from tests.trace_runs import write_synthetic_run


def test_one_lane_per_rank_on_one_clock(tmp_path):
    # Each rank's base time is a second apart and its ts a second smaller: the same instants.
    run = write_synthetic_run(tmp_path / "run", ranks=3, steps=2, ops_per_step=4, base_skew_s=1)
    sources = {r: json.loads(p.read_text()) for r, p in trace_files(run).items()}

    path = merge_traces(run)
    assert path == run / MERGED_NAME
    merged = json.loads(path.read_text())
    events = merged["traceEvents"]

    lanes = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert lanes == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    # Every real event is kept, in its rank's lane.
    for rank, trace in sources.items():
        kept = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        assert len(kept) == sum(e["ph"] == "X" for e in trace["traceEvents"])
    # Aligned: the ranks started step 1 at the same instant, the run's earliest: ts 0 everywhere.
    step1 = {e["pid"]: e["ts"] for e in events if e.get("name") == "ProfilerStep#1"}
    assert step1 == {0: 0.0, 1: 0.0, 2: 0.0}
    # ts 0 still means the same wall-clock instant as in the sources.
    first0 = min(e["ts"] for e in sources[0]["traceEvents"] if e["ph"] == "X")
    assert merged["baseTimeNanoseconds"] == sources[0]["baseTimeNanoseconds"] + first0 * 1000


def test_merged_file_is_not_mistaken_for_a_rank(tmp_path):
    run = write_synthetic_run(tmp_path / "run", ranks=2, steps=2, ops_per_step=4)
    merge_traces(run)
    assert sorted(trace_files(run)) == [0, 1]
    assert sorted(load_trace(run)["rank"].unique()) == [0, 1]
