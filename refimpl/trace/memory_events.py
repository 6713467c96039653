"""Peak memory inside a step, from the CPU allocator's own events.

Counting tensors by category (refimpl.memory) says what a rank *keeps* between steps. ZeRO-3 and
FSDP differ from each other in what they hold for a moment *during* the step: gathered parameters,
full-size gradient buffers, prefetched units. On a GPU `torch.cuda.max_memory_allocated` answers
that. On CPU ranks the profiler does: with `profile_memory=True` the CPU allocator reports every
allocation and free, with the running total of bytes allocated since profiling began, as a
`[memory]` event.

The loop's StepProfiler records every thread (for asynchronous collectives), and in torch 2.13 that
mode drops the allocator's events. So memory gets a run of its own:

    results = train_several_recording_memory(cfgs, record_memory=[True, False, ...])
    results[0]["transient_peak"]     # rank -> bytes

runs the configurations one after another in one launch (as train_several_on_ranks does). Each
one marked runs under a memory-only profiler; its result gains `transient_peak`: per rank, the most
any step after the first allocated on top of what it began with. (The first step also creates
Adam's m and v, which are kept, not transient.) Steps are found from the strategies' own
`phase()` labels: a step runs from its first forward to the end of its optimizer phase. Every
allocation through PyTorch's CPU allocator counts, whatever the strategy: tensors of PyTorch's FSDP2
and gloo's temporary copies included.

The peak a rank needs is its kept model state plus `transient_peak`.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from refimpl.trace.profiling import read_trace
from refimpl.strategy import TrainConfig


def train_several_recording_memory(cfgs: list[TrainConfig], record_memory: list[bool],
                                   timeout: float = 900.0) -> list[dict]:
    """train_several_on_ranks, where each config with `record_memory` also reports its
    `transient_peak` (rank -> bytes). Those configs must not set `profile` (one profiler at a
    time)."""
    from refimpl import launch
    from refimpl.train import merge_results, validate

    if len(cfgs) != len(record_memory):
        raise ValueError("one record_memory flag per configuration")
    if any(c.profile and m for c, m in zip(cfgs, record_memory)):
        raise ValueError("a configuration recording memory cannot also be profiled by the loop")
    if len({c.nproc for c in cfgs}) != 1:
        raise ValueError("every configuration needs the same nproc")
    for cfg in cfgs:
        validate(cfg)
    runs = launch.run(_train_several, cfgs[0].nproc, cfgs, record_memory, timeout=timeout,
                      quiet=True)
    out = []
    for i, (cfg, recorded) in enumerate(zip(cfgs, record_memory)):
        merged = merge_results(cfg, [rank_runs[i][0] for rank_runs in runs])
        if recorded:
            merged["transient_peak"] = {r: rank_runs[i][1] for r, rank_runs in enumerate(runs)}
        out.append(merged)
    return out


def _train_several(rank: int, world_size: int, cfgs, record_memory) -> list[tuple]:
    from refimpl.train import train_rank

    out = []
    for cfg, recorded in zip(cfgs, record_memory):
        if not recorded:
            out.append((train_rank(rank, world_size, cfg), None))
            continue
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = train_rank(rank, world_size, cfg)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            out.append((result, transient_peak(Path(path))))
        finally:
            os.unlink(path)
    return out


def step_windows(events: list[dict]) -> list[tuple[float, float]]:
    """(start, end) of each step: from its first forward to the end of its optimizer phase."""
    phases = sorted((ev["ts"], ev["ts"] + ev["dur"], ev["name"]) for ev in events
                    if ev.get("ph") == "X" and ev.get("name") in ("forward", "backward",
                                                                 "optimizer"))
    windows, start = [], None
    for begin, end, name in phases:
        if start is None:
            start = begin
        if name == "optimizer":
            windows.append((start, end))
            start = None
    return windows


def transient_peak(trace: Path) -> int:
    """The most bytes any step after the first allocated on top of what it started with."""
    events = read_trace(trace).get("traceEvents", [])
    memory = sorted((ev["ts"], ev["args"]["Total Allocated"], ev["args"]["Bytes"])
                    for ev in events
                    if ev.get("name") == "[memory]" and ev.get("args", {}).get("Device Type") == 0)
    if not memory:
        raise ValueError(f"{trace} has no allocator events (profile_memory=True, and not "
                         "profile_all_threads, which in torch 2.13 drops them)")
    windows = step_windows(events)
    peaks = []
    for start, end in windows[1:] or windows:
        inside = [(total, nbytes) for ts, total, nbytes in memory if start <= ts < end]
        if inside:
            base = inside[0][0] - inside[0][1]     # the total just before the step's first event
            peaks.append(max(base, max(total for total, _ in inside)) - base)
    return max(peaks)
