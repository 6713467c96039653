"""One Chrome-trace file for a whole run: every rank as its own process lane, on one clock.

    path = merge_traces("profiles/02_dp/dp-n4")      # -> profiles/02_dp/dp-n4/merged.trace.json

Each rank's profiler writes its own trace (`rank<r>.<id>.pt.trace.json`). Opened one at a time in
chrome://tracing or Perfetto, nothing shows that rank 1 waited in an all-reduce while rank 0 was
still in its backward pass. Merged, the lanes line up and the wait is visible.

Clocks. A Kineto trace gives each event's `ts` in microseconds relative to the file's
`baseTimeNanoseconds`, so an event's absolute time is `baseTimeNanoseconds / 1000 + ts`. Two ranks
may carry different bases (each process picks its own), so we place every rank on the absolute
clock and shift the whole run so its earliest event sits at 0. Ranks on one host share that clock
exactly; ranks on several nodes are only as aligned as NTP keeps them.

Lanes. Every event of rank r gets `pid = r` (Chrome-trace viewers draw one process per pid) and
the lane is named "rank r"; thread ids are kept, so the gloo/NCCL worker threads stay separate rows.
The output's name must never match `rank*.pt.trace.json`, or `load_trace` would read it as a rank.
"""
from __future__ import annotations

import json
from pathlib import Path

from refimpl.lab.trace.profiling import rank_clock_shifts, read_trace, trace_files

MERGED_NAME = "merged.trace.json"

# Metadata events that name or order a process: we replace them with our own "rank r" lane.
_PROCESS_METADATA = {"process_name", "process_labels", "process_sort_index"}


def merged_trace(run_dir: str | Path) -> dict:
    """The merged trace as a dict (Chrome trace format), without writing it anywhere."""
    traces = {rank: read_trace(path) for rank, path in sorted(trace_files(run_dir).items())}
    if not traces:
        raise FileNotFoundError(f"no rank*.pt.trace.json files in {run_dir}")

    bases = {rank: int(t.get("baseTimeNanoseconds", 0)) for rank, t in traces.items()}
    base0 = min(bases.values())
    shift = rank_clock_shifts(bases)
    starts = [ev["ts"] + shift[rank] for rank, t in traces.items()
              for ev in t.get("traceEvents", []) if _has_time(ev)]
    origin = min(starts) if starts else 0.0

    events = []
    for rank, trace in traces.items():
        events += _lane_metadata(rank)
        for ev in trace.get("traceEvents", []):
            if ev.get("ph") == "M" and ev.get("name") in _PROCESS_METADATA:
                continue
            ev = dict(ev, pid=rank)
            if _has_time(ev):
                ev["ts"] = round(ev["ts"] + shift[rank] - origin, 3)
            if "id" in ev:  # flow/async ids are per process; keep them from colliding across ranks
                ev["id"] = f"{rank}:{ev['id']}"
            events.append(ev)

    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        # Absolute time of ts == 0, so the merged file keeps the wall-clock anchor the ranks had.
        "baseTimeNanoseconds": base0 + int(round(origin * 1000)),
        "distributedInfo": {rank: t.get("distributedInfo") for rank, t in traces.items()},
    }


def merge_traces(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the merged trace (default `<run_dir>/merged.trace.json`) and return its path."""
    out = Path(out) if out is not None else Path(run_dir) / MERGED_NAME
    merged = merged_trace(run_dir)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(merged))
    tmp.replace(out)  # a viewer polling the folder never sees half a file
    return out


def _has_time(ev: dict) -> bool:
    # Metadata events carry a `ts` too, but it means nothing; only real events are placed in time.
    return ev.get("ph") != "M" and isinstance(ev.get("ts"), (int, float))


def _lane_metadata(rank: int) -> list[dict]:
    return [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
         "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
         "args": {"sort_index": rank}},
    ]
