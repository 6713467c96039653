"""Peak memory inside a step, read back from the profiler's allocation events.

Counting tensors by category (refimpl.memory) says what a rank *keeps* between steps; ZeRO-3 and
FSDP differ from each other in what they hold for a moment *during* the step -- gathered
parameters, full-size gradient buffers, prefetched units. On a GPU `torch.cuda.max_memory_allocated`
answers that. On CPU ranks the profiler does: with `profile_memory=True` (refimpl.profiling's
StepProfiler sets it) the CPU allocator reports every allocation and free with the running total
of bytes allocated since profiling began, as a `[memory]` instant event in the trace.

`step_memory(run_dir)` turns those into one row per rank and profiled step:

    base_bytes       allocated when the step began (the total counts only blocks allocated since
                     the profiler started, so the persistent model state is mostly not in it)
    peak_bytes       the most allocated at any moment of the step
    transient_bytes  peak - base: what the step needed on top of what it started with

The peak a rank needs is then its model state (refimpl.memory) plus `transient_bytes`. Every
allocation through PyTorch's CPU allocator counts -- tensors of any strategy, PyTorch's FSDP2
included -- but not the communication library's private buffers.
"""
from __future__ import annotations

from pathlib import Path

from refimpl.profiling import read_trace, trace_files


def step_memory(run: str | Path):
    """Per rank and profiled step: base, peak and transient bytes (see the module docstring)."""
    import pandas as pd

    rows = []
    for rank, path in trace_files(run).items():
        events = read_trace(path).get("traceEvents", [])
        steps = sorted((ev["ts"], ev["ts"] + ev["dur"], int(ev["name"].split("#")[1]))
                       for ev in events
                       if ev.get("ph") == "X" and ev.get("name", "").startswith("ProfilerStep#"))
        memory = sorted((ev["ts"], ev["args"]["Total Allocated"], ev["args"]["Bytes"])
                        for ev in events
                        if ev.get("name") == "[memory]" and ev.get("args", {}).get("Device Type") == 0)
        if steps and not memory:
            raise ValueError(
                f"{path} has no allocator events: record with profile_memory=True (StepProfiler "
                "does) and without _ExperimentalConfig(profile_all_threads=True), which in torch "
                "2.13 drops every [memory] event")
        for start, end, step in steps:
            inside = [(total, nbytes) for ts, total, nbytes in memory if start <= ts < end]
            if not inside:
                continue
            base = inside[0][0] - inside[0][1]   # the total just before the step's first event
            peak = max(base, max(total for total, _ in inside))
            rows.append({"rank": rank, "step": step, "base_bytes": base, "peak_bytes": peak,
                         "transient_bytes": peak - base})
    return pd.DataFrame(rows, columns=["rank", "step", "base_bytes", "peak_bytes",
                                       "transient_bytes"])


def transient_peak(run: str | Path) -> dict[int, int]:
    """rank -> the largest `transient_bytes` over its profiled steps."""
    df = step_memory(run)
    return {int(r): int(g.transient_bytes.max()) for r, g in df.groupby("rank")}
