"""Reading a profile back: every rank's trace as one DataFrame, and where the time went.

`load_trace(run_dir)` turns every rank's trace into one DataFrame (rank, name, category, start_us,
dur_us, step); `summarize(df)` gives per rank the time spent computing, communicating, both at once
(overlap) and neither (idle) inside the profiled steps: from our labelled ranges
(refimpl.lab.instrument.labels) on CPU ranks, from the GPU streams' kernels on CUDA runs
(refimpl.lab.trace.kernels explains why). The ranks' clocks are one host clock on one machine; on
several nodes only as aligned as NTP. Traces are written by refimpl.lab.trace.capture.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import shutil
from pathlib import Path

from refimpl.lab.instrument.labels import BACKEND_RANGES, COMM_LABEL, PHASES, categorize
from refimpl.lab.trace import kernels


def trace_files(run: str | Path) -> dict[int, Path]:
    """rank -> its newest trace file in a run folder."""
    found: dict[int, Path] = {}
    for path in sorted(Path(run).glob("rank*.pt.trace.json*"), key=lambda p: p.stat().st_mtime):
        m = re.match(r"rank(\d+)\.", path.name)
        if m:
            found[int(m.group(1))] = path
    return found


def rank_traces_only(run: str | Path, dest: str | Path) -> Path:
    """A folder `dest` holding each rank's newest trace of `run` and nothing else (hard links, or
    copies where a link cannot be made), for readers that take every *.json of a folder as a
    rank's trace: HolisticTraceAnalysis fails on the run_summary.json a profiled run leaves
    beside its traces (refimpl.lab.trace.run_record), and would read an older run's trace too."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ValueError(f"{dest} already holds files: give rank_traces_only an empty folder")
    for path in trace_files(run).values():
        try:
            os.link(path, dest / path.name)
        except OSError:
            shutil.copy2(path, dest / path.name)
    return dest


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def rank_clock_shifts(base_ns: dict[int, int]) -> dict[int, float]:
    """µs to add to each rank's event times to put every rank on one clock.

    A trace's event times are µs after its own `baseTimeNanoseconds`; adding the base puts every
    rank on the host's clock, so ranks whose profilers started at different moments line up.
    Only the bases' differences are added (small numbers), not ~1e15 µs, to keep sub-µs
    precision. Ranks on one host share that clock exactly; on several nodes they are only as
    aligned as NTP keeps them. The loader here and the merged trace (refimpl.lab.trace.merge) both
    use this."""
    first = min(base_ns.values())
    return {rank: (base - first) / 1000 for rank, base in base_ns.items()}


def load_trace(run: str | Path, include_ops: bool = False):
    """Every rank's labelled ranges as one DataFrame, times in µs from the run's first event.

    Columns: rank, name, category, op (for comm: the collective), bytes, start_us, dur_us, step;
    on a CUDA run also gpu_start_us / gpu_dur_us, the GPU time of each label's kernels
    (kernels.gpu_spans; NaN on CPU ranks and for ranges that launched no kernel).
    `include_ops=True` keeps every aten op too (large); by default only our labels, the step
    markers and the backends' own collective events are kept.
    """
    import pandas as pd

    rows = []
    for rank, path in trace_files(run).items():
        trace = read_trace(path)
        base_ns = int(trace.get("baseTimeNanoseconds", 0))     # see rank_clock_shifts
        kernel_rows, launches, labelled, spanned, staging = [], {}, [], [], []
        for ev in trace.get("traceEvents", []):
            if kernels.is_launch(ev):
                launches[kernels.correlation(ev)] = (ev.get("tid"), float(ev["ts"]))
            if ev.get("ph") != "X" or "dur" not in ev:
                continue
            name = ev.get("name", "")
            if ev.get("cat") == "gpu_user_annotation":
                # Kineto's copy of a record_function range on the GPU timeline (CUDA runs): the
                # label is its CPU range, once; the kernels inside carry their own GPU time.
                continue
            if kernels.is_gpu_event(ev):     # a kernel / copy on a GPU stream (CUDA runs only)
                kernel_rows.append({
                    "rank": rank, "name": name, "category": kernels.kernel_category(name),
                    "op": None, "bytes": None, "start_us": float(ev["ts"]), "base_ns": base_ns,
                    "dur_us": float(ev["dur"]), "thread": f"stream {ev.get('tid')}",
                    "correlation": kernels.correlation(ev)})
                continue
            if name == kernels.STAGING_COPY:  # the staged backend's copies on a GPU (kernels)
                staging.append((ev.get("tid"), float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])))
            cat = categorize(name)
            if cat == "op" and not include_ops:
                continue
            m = COMM_LABEL.match(name)
            rows.append({
                "rank": rank, "name": name, "category": cat,
                "op": (m.group("op") if m else name.split(":")[-1]) if cat == "comm" else None,
                "bytes": int(m.group("bytes")) if m and m.group("bytes") else None,
                "start_us": float(ev["ts"]), "base_ns": base_ns, "dur_us": float(ev["dur"]),
                "thread": ev.get("tid"), "label": None, "label_id": None, "launch_us": None,
            })
            if cat in PHASES or cat == "comm":
                labelled.append((ev.get("tid"), float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]),
                                 name))
            if cat != "op" or name.startswith("pp:"):     # ranges whose GPU time is asked for
                spanned.append((len(rows) - 1, (ev.get("tid"), float(ev["ts"]),
                                                float(ev["ts"]) + float(ev["dur"]), cat == "comm")))
        kernels.mark_staging_copies(kernel_rows, launches, staging)
        kernels.label_kernels(kernel_rows, launches, labelled)
        found = kernels.gpu_spans(kernel_rows, launches, [r for _, r in spanned])
        for j, (row_index, _) in enumerate(spanned):
            if j in found:
                rows[row_index]["gpu_start_us"] = found[j][0]
                rows[row_index]["gpu_dur_us"] = found[j][1] - found[j][0]
        for k in kernel_rows:
            k.pop("correlation")
        rows += kernel_rows
    df = pd.DataFrame(rows, columns=["rank", "name", "category", "op", "bytes", "start_us",
                                     "base_ns", "dur_us", "thread", "label", "label_id", "launch_us",
                                     "gpu_start_us", "gpu_dur_us"])
    base_ns = df.pop("base_ns")
    if df.empty:
        return df.assign(step=pd.Series(dtype="Int64"))
    shifts = df["rank"].map(rank_clock_shifts(dict(zip(df["rank"], base_ns))))
    df["start_us"] += shifts
    df["launch_us"] = df["launch_us"].astype(float) + shifts
    df["gpu_start_us"] = df["gpu_start_us"].astype(float) + shifts
    df["gpu_dur_us"] = df["gpu_dur_us"].astype(float)
    origin = df["start_us"].min()
    df["start_us"] -= origin
    df["launch_us"] -= origin
    df["gpu_start_us"] -= origin
    df["step"] = _step_of(df)
    return df.sort_values(["rank", "start_us"]).reset_index(drop=True)


def _step_of(df):
    """The ProfilerStep#N range each event starts in (per rank), or <NA> outside any step; a GPU
    kernel belongs to the step its launch is in."""
    import pandas as pd

    steps = pd.Series(pd.NA, index=df.index, dtype="Int64")
    markers = df[df.category == "step"]
    when = df.launch_us.fillna(df.start_us)
    for _, m in markers.iterrows():
        n = int(m["name"].split("#")[1])
        inside = ((df["rank"] == m["rank"]) & (when >= m.start_us)
                  & (when < m.start_us + m.dur_us))
        steps[inside] = n
    return steps


def _time_split(phases, comms, windows) -> dict:
    """Split the time inside `windows` into compute-only, comm-only, both, and neither.

    A rank is *computing* at time t if some phase range covers t on a thread that is not, at that
    moment, inside a communication call of its own (a phase that waits on a blocking collective is
    not computing). It is *communicating* if any comm range covers t. A comm range is
    (start, end, thread, in_flight): a backend's range (gloo:…, nccl:…) is the collective in
    flight, not time its thread spends in a call, so it never stops a thread computing. gloo
    records it on its own worker thread; the staged backend on the caller's, from the call until
    the collective completes (refimpl.lab.runtime.shared_device). Exact: the timeline is cut at every range
    boundary and each piece is classified.
    """
    cuts = sorted({x for s, e, *_ in phases + comms for x in (s, e)} | {x for w in windows for x in w})
    split = {"compute": 0.0, "comm": 0.0, "overlap": 0.0, "idle": 0.0}
    for left, right in zip(cuts, cuts[1:]):
        mid = (left + right) / 2
        if not any(s <= mid < e for s, e in windows):
            continue
        open_comms = [(t, in_flight) for s, e, t, in_flight in comms if s <= mid < e]
        in_a_call = {t for t, in_flight in open_comms if not in_flight}
        computing = any(s <= mid < e and t not in in_a_call for s, e, t in phases)
        key = ("overlap" if open_comms else "compute") if computing else (
            "comm" if open_comms else "idle")
        split[key] += right - left
    return split


def summarize(df):
    """Per rank, inside the profiled steps: time computing only, communicating only, both at once
    (communication hidden under compute), and neither (idle), in µs and as fractions of the step.

    `source` says what was read: "gpu kernels" when the rank's trace has GPU kernels (a CUDA run:
    NCCL kernels and the staged backend's copies are communication, every other kernel compute;
    refimpl.lab.trace.kernels), else
    "cpu ranges" (our labelled phases and comm:<op> ranges, which on CPU ranks time the work).
    """
    import pandas as pd

    out = []
    for rank, g in df.groupby("rank"):
        steps = g[g.category == "step"]
        windows = [(r.start_us, r.start_us + r.dur_us) for r in steps.itertuples()]
        on_gpu = g.category.isin(["gpu", "gpu_comm"]).any()
        if on_gpu:
            busy = {c: [(r.start_us, r.start_us + r.dur_us) for r in g[g.category == c].itertuples()]
                    for c in ("gpu", "gpu_comm")}
            split = kernels.split_busy_time(busy["gpu"], busy["gpu_comm"], windows)
        else:
            phases = [(r.start_us, r.start_us + r.dur_us, r.thread)
                      for r in g.itertuples() if r.category in PHASES]
            comms = [(r.start_us, r.start_us + r.dur_us, r.thread, r.name.startswith(BACKEND_RANGES))
                     for r in g.itertuples() if r.category == "comm"]
            split = _time_split(phases, comms, windows)
        span = sum(e - s for s, e in windows)
        row = {"rank": rank, "steps": len(windows), "step_us": span,
               "source": "gpu kernels" if on_gpu else "cpu ranges"}
        row.update({f"{k}_us": v for k, v in split.items()})
        row.update({f"{k}_frac": (v / span if span else 0.0) for k, v in split.items()})
        comm_total = split["comm"] + split["overlap"]
        row["comm_hidden_frac"] = split["overlap"] / comm_total if comm_total else 0.0
        out.append(row)
    return pd.DataFrame(out)


def comm_table(df):
    """Per rank and op: count, bytes, total time, effective bandwidth (bytes/s) of labelled comms.

    On a CUDA run the time is the NCCL kernels' (grouped by the `comm:<op>` call that launched
    them), not the CPU range's, which only times the launch. A staged run on a GPU has no NCCL
    kernel (its copies are only a part of its calls): its calls block until the result is back
    on the device, so their CPU ranges time them whole.
    """
    nccl = df["name"].map(kernels.kernel_category) == "gpu_comm"
    gpu = df[(df.category == "gpu_comm") & nccl & df.label.fillna("").str.startswith("comm:")
             & df.step.notna()]
    if not gpu.empty:
        calls = gpu.groupby(["rank", "label_id"]).agg(label=("label", "first"),
                                                      dur_us=("dur_us", "sum")).reset_index()
        parsed = calls.label.str.extract(COMM_LABEL.pattern)
        labelled = calls.assign(name=calls.label, op=parsed["op"],
                                bytes=parsed["bytes"].astype(float))
    else:
        labelled = df[(df.category == "comm") & df["name"].str.startswith("comm:") & df.step.notna()]
    if labelled.empty:
        import pandas as pd
        return pd.DataFrame(columns=["rank", "op", "count", "bytes", "time_us", "GB_per_s"])
    t = labelled.groupby(["rank", "op"]).agg(count=("name", "size"), bytes=("bytes", "sum"),
                                             time_us=("dur_us", "sum")).reset_index()
    t["GB_per_s"] = t["bytes"] / (t["time_us"] * 1e-6) / 1e9
    return t
