"""Peak memory inside a step: the allocator's own account, on CPU and on CUDA.

Counting tensors by category (refimpl.memory) says what a rank *keeps* between steps. Strategies
differ most in what they hold for a moment *during* the step: gathered parameters, full-size
gradient buffers (ZeRO-1 keeps one through backward, ZeRO-2 does not), prefetched units. The loop
records that with `StepPeak` when `LabConfig.record_memory` is set (the CLI sets it):

  * CUDA: `torch.cuda.max_memory_allocated`, reset when the second step begins;
  * CPU: the profiler with `profile_memory=True`, whose `[memory]` events carry the CPU
    allocator's running total. Every allocation through PyTorch's CPU allocator counts, whatever
    the strategy: PyTorch FSDP2's tensors and gloo's temporary copies included. The loop's own
    StepProfiler (--profile) records every thread, and in torch 2.13 that mode drops the
    allocator's events, so a profiled run reports no CPU peak.

Two numbers per rank, for the steps after the first (the first also creates Adam's m and v, which
are kept, not transient): `transient_peak`, the most allocated on top of what the step began with,
and `peak`, what the rank held at that moment (the kept model state plus the transient).
Steps are found from the strategies' own `phase()` labels: a step runs from its first forward to
the end of its optimizer phase.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from refimpl.lab.trace.profiling import read_trace


class StepPeak:
    """Around the loop: `with StepPeak(device, enabled) as peak: ... peak.step_begins(i) ...`,
    then `peak.result(kept_bytes)` -> {"peak": bytes, "transient_peak": bytes} (None: not measured)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled
        self._prof = None
        self._cuda_base = None
        self._transient = None

    def __enter__(self) -> "StepPeak":
        if self.enabled and self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def step_begins(self, step: int) -> None:
        if self.enabled and self.device.type == "cuda" and step == 1:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            if exc[0] is None:
                fd, path = tempfile.mkstemp(suffix=".json")
                os.close(fd)
                try:
                    self._prof.export_chrome_trace(path)
                    self._transient = transient_peak(Path(path))
                finally:
                    os.unlink(path)
        elif self._cuda_base is not None:
            self._transient = torch.cuda.max_memory_allocated(self.device) - self._cuda_base

    def result(self, kept_bytes: int) -> dict:
        if self._transient is None:
            return {"peak": None, "transient_peak": None}
        return {"peak": int(kept_bytes + self._transient), "transient_peak": int(self._transient)}


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
