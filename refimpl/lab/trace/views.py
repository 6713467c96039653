"""JSON-ready views of one run's traces: what a timeline page, a table or a scalar chart needs.

Everything here starts from `refimpl.lab.trace.profiling.load_trace(run)` and its `summarize` / `comm_table`,
so the numbers a viewer shows are the numbers a notebook computes; this module only slices them
by step and turns them into lists of plain dicts.

Steps are the profiler's `ProfilerStep#N` numbers, which are the loop's step indices. Large runs are
viewed a window of steps at a time (`StepWindow`), never refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from refimpl.lab.instrument.labels import PHASES
from refimpl.lab.trace.profiling import comm_table, summarize

DEFAULT_WINDOW = 4   # steps shown when a viewer asks for none: enough to see a steady state

SUMMARY_COLUMNS = ["rank", "source", "steps", "step_us", "compute_us", "comm_us", "overlap_us",
                   "idle_us", "compute_frac", "comm_frac", "overlap_frac", "idle_frac",
                   "comm_hidden_frac"]


@dataclass(frozen=True)
class StepWindow:
    """An inclusive range of profiled steps, e.g. StepWindow(2, 5); (0, -1) is empty."""
    first: int
    last: int

    @classmethod
    def parse(cls, text: str | None, available: list[int]) -> "StepWindow":
        """"3:6" (inclusive), "4" (one step), "4:" / ":6" (open-ended); None or "" -> the first
        DEFAULT_WINDOW profiled steps."""
        if not available:
            return cls(0, -1)
        if not text:
            return cls(available[0], available[min(DEFAULT_WINDOW, len(available)) - 1])
        lo, hi = text.split(":", 1) if ":" in text else (text, text)
        first = int(lo) if lo.strip() else available[0]
        last = int(hi) if hi.strip() else available[-1]
        if last < first:
            raise ValueError(f"step window {text!r} ends before it starts")
        first, last = max(first, available[0]), min(last, available[-1])   # what exists of it
        if last < first:
            raise ValueError(f"no profiled step in {text!r}: the run has steps "
                             f"{available[0]} to {available[-1]}")
        return cls(first, last)

    def select(self, df):
        return df[df.step.notna() & (df.step >= self.first) & (df.step <= self.last)]

    def as_list(self) -> list[int]:
        return [self.first, self.last]


def profiled_steps(df) -> list[int]:
    return sorted(int(s) for s in df.loc[df.category == "step", "step"].dropna().unique())


def lane_row(category: str, name: str) -> str:
    """Which row of a rank's lane a range is drawn in.

    compute: our phase labels. comm: our `comm:<op>` labels, i.e. the time the calling thread spends
    in the call. backend: the backend's own collective events (gloo:…, nccl:…), which for an
    asynchronous collective run on the backend's worker thread while the caller computes.
    gpu / gpu comm: a CUDA run's kernels on the GPU's streams (NCCL's in "gpu comm").
    """
    if category == "gpu":
        return "gpu"
    if category == "gpu_comm":
        return "gpu comm"
    if category in PHASES:
        return "compute"
    if category == "comm":
        return "comm" if name.startswith("comm:") else "backend"
    return category   # "step": drawn as the lane's background, so gaps inside a step show as idle


def timeline(df, window: StepWindow) -> dict:
    """The ranges of every rank inside the window, one dict per range, ready to draw."""
    part = window.select(df)
    spans = part.assign(row=[lane_row(c, n) for c, n in zip(part.category, part.name)])
    cols = ["rank", "row", "name", "category", "op", "bytes", "start_us", "dur_us", "step", "label"]
    return {"ranks": sorted(int(r) for r in df["rank"].unique()),
            "spans": records(spans[cols])}


def step_breakdown(df, window: StepWindow | None = None):
    """`summarize` for each step on its own: one row per (step, rank)."""
    import pandas as pd

    steps = [s for s in profiled_steps(df) if window is None or window.first <= s <= window.last]
    parts = [summarize(df[df.step == s]).assign(step=s) for s in steps]
    if not parts:
        return pd.DataFrame(columns=["step"] + SUMMARY_COLUMNS)
    return pd.concat(parts, ignore_index=True)[["step"] + SUMMARY_COLUMNS]


def breakdown(df, window: StepWindow) -> dict:
    """Per rank over the whole window, and per step and rank: compute / comm / overlap / idle."""
    part = window.select(df)
    per_rank = summarize(part) if not part.empty else None
    return {"per_rank": records(per_rank[SUMMARY_COLUMNS]) if per_rank is not None else [],
            "per_step": records(step_breakdown(df, window))}


def communication(df, window: StepWindow) -> dict:
    """Per rank and op: count, bytes, total time, effective bandwidth, inside the window."""
    table = comm_table(window.select(df)).sort_values(["op", "rank"])
    return {"rows": records(table)}


def memory(run_summary: dict | None) -> dict:
    """Bytes per rank by category, from the run_summary.json the training loop writes."""
    if not run_summary:
        return {"ranks": []}
    return {"ranks": [dict(m, rank=r) for r, m in enumerate(run_summary.get("memory", []))]}


def records(df) -> list[dict]:
    """Rows as plain dicts; pandas' own JSON writer turns NaN and <NA> into null."""
    if df is None or df.empty:
        return []
    return json.loads(df.to_json(orient="records"))


def run_label(run: Path, logdir: Path) -> str:
    """A run's name as TensorBoard shows it: its folder relative to the logdir."""
    rel = run.relative_to(logdir).as_posix()
    return "." if rel == "" else rel
