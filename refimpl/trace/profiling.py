"""Where the time went: per-rank torch.profiler traces, labelled, and a loader that reads them back.

Capture. Every rank profiles its own steps into one run folder, in TensorBoard's layout
(`profiles/<notebook>/<run>/rank<r>.<id>.pt.trace.json`), so `make tensorboard` lists the run and
its profiler plugin shows one worker per rank. A schedule marks each step (ProfilerStep#N).

Labels. The code under test wraps its phases in `phase("forward" | "backward" | "optimizer")` and
every collective in `comm_span(op, nbytes)` -> a `comm:<op> <n>B` range. Both are plain
`record_function` ranges: free when no profiler is running.

Reading. `load_trace(run_dir)` turns every rank's trace into one DataFrame (rank, name, category,
start_us, dur_us, step); `summarize(df)` gives per rank the time spent computing, communicating,
both at once (overlap) and neither (idle) inside the profiled steps: from our labelled ranges on
CPU ranks, from the GPU streams' kernels on CUDA runs (refimpl.trace.kernels explains why). The
ranks' clocks are one host clock on one machine; on several nodes only as aligned as NTP.
"""
from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

from refimpl.trace import kernels

# torch is imported inside the capture functions only: the reading half of this module is what the
# TensorBoard plugin loads, and it should not pay for importing torch.

PHASES = ("forward", "backward", "optimizer")
_COMM = re.compile(r"^comm:(?P<op>[\w\-]+)(?: (?P<bytes>\d+)B)?$")


# --- where traces go --------------------------------------------------------------------------------

def profiles_root() -> Path:
    """The TensorBoard logdir: $REFIMPL_PROFILES, else the repo's profiles/ folder, else ./profiles."""
    if os.environ.get("REFIMPL_PROFILES"):
        return Path(os.environ["REFIMPL_PROFILES"]).resolve()
    repo_profiles = Path(__file__).resolve().parents[2] / "profiles"   # refimpl/trace/ -> repo
    if repo_profiles.is_dir():
        return repo_profiles
    return Path.cwd() / "profiles"


def run_dir(group: str, run: str) -> Path:
    """profiles/<group>/<run>, e.g. run_dir("00_memory", "single-step")."""
    return profiles_root() / group / run


# --- labels -----------------------------------------------------------------------------------------

def profiled(cfg, group: str, run: str):
    """`cfg` with profiling on, writing to profiles/<group>/<run> (a notebook's runs, by name)."""
    return cfg.with_(profile=True, trace_dir=str(run_dir(group, run)))


def phase(name: str):
    """Label a phase of a step (forward, backward, optimizer, or any compute you name)."""
    from torch.profiler import record_function

    return record_function(name)


def comm_span(op: str, nbytes: int | None = None):
    """Label one communication call; bytes in the name let the loader build a bandwidth table."""
    from torch.profiler import record_function

    return record_function(f"comm:{op}" + (f" {int(nbytes)}B" if nbytes is not None else ""))


# --- capture ----------------------------------------------------------------------------------------

def _all_threads_config(all_threads: bool):
    """Optionally record every thread, not only the one that started the profiler.

    refimpl.comm's asynchronous collectives run on a worker thread of their own, which the default
    profiler does not see (the backends' own threads, gloo's and NCCL's, are recorded either way).
    It is opt-in because in torch 2.13 recording all threads drops the allocator's memory events,
    which TensorBoard's memory view needs.
    """
    if not all_threads:
        return None
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:            # an older torch without the option: the calling thread only
        return None


class StepProfiler:
    """Profile a loop of steps on this rank; call `.step()` after each one.

    The first step is warm-up (allocations, lazy inits), the next `active` steps are recorded.
    With a single step, that step is recorded.
    """

    def __init__(self, out_dir: str | Path | None, rank: int, steps: int, active: int = 3,
                 all_threads: bool = False, device=None):
        self.enabled = out_dir is not None
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if not self.enabled:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        warmup = 1 if steps > 1 else 0
        active = max(1, min(active, steps - warmup))
        activities = [ProfilerActivity.CPU]
        # GPU kernels when this rank computes on a GPU (device None: whenever there is one). A CPU
        # rank on a GPU machine skips CUPTI: it would only start a CUDA context per rank.
        on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        if on_gpu:
            activities.append(ProfilerActivity.CUDA)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(self.out_dir), worker_name=f"rank{rank}"),
            record_shapes=False, profile_memory=True, with_stack=False,
            experimental_config=_all_threads_config(all_threads))

    def __enter__(self):
        if self.enabled:
            from refimpl.trace.native_stderr import quiet_profiler_in_notebook

            self._quiet = quiet_profiler_in_notebook()   # kineto's start/stop lines, in a kernel
            self._quiet.__enter__()
            self._prof.__enter__()
        return self

    def step(self) -> None:
        if self.enabled:
            self._prof.step()

    def __exit__(self, *exc):
        if self.enabled:
            try:
                self._prof.__exit__(*exc)
            finally:
                self._quiet.__exit__(*exc)


# --- reading ----------------------------------------------------------------------------------------

def trace_files(run: str | Path) -> dict[int, Path]:
    """rank -> its newest trace file in a run folder."""
    found: dict[int, Path] = {}
    for path in sorted(Path(run).glob("rank*.pt.trace.json*"), key=lambda p: p.stat().st_mtime):
        m = re.match(r"rank(\d+)\.", path.name)
        if m:
            found[int(m.group(1))] = path
    return found


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def categorize(name: str) -> str:
    """forward / backward / optimizer / comm / step / op, from a range's name."""
    if name in PHASES:
        return name
    if _COMM.match(name) or name.startswith(("gloo:", "nccl:", "c10d::", "record_param_comms")):
        return "comm"
    if name.startswith("ProfilerStep#"):
        return "step"
    return "op"


def rank_clock_shifts(base_ns: dict[int, int]) -> dict[int, float]:
    """µs to add to each rank's event times to put every rank on one clock.

    A trace's event times are µs after its own `baseTimeNanoseconds`; adding the base puts every
    rank on the host's clock, so ranks whose profilers started at different moments line up.
    Only the bases' differences are added (small numbers), not ~1e15 µs, to keep sub-µs
    precision. Ranks on one host share that clock exactly; on several nodes they are only as
    aligned as NTP keeps them. The loader here and the merged trace (refimpl.trace.merge) both
    use this."""
    first = min(base_ns.values())
    return {rank: (base - first) / 1000 for rank, base in base_ns.items()}


def load_trace(run: str | Path, include_ops: bool = False):
    """Every rank's labelled ranges as one DataFrame, times in µs from the run's first event.

    Columns: rank, name, category, op (for comm: the collective), bytes, start_us, dur_us, step.
    `include_ops=True` keeps every aten op too (large); by default only our labels, the step
    markers and the backends' own collective events are kept.
    """
    import pandas as pd

    rows = []
    for rank, path in trace_files(run).items():
        trace = read_trace(path)
        base_ns = int(trace.get("baseTimeNanoseconds", 0))     # see rank_clock_shifts
        kernel_rows, launches, labelled = [], {}, []
        for ev in trace.get("traceEvents", []):
            if kernels.is_launch(ev):
                launches[kernels.correlation(ev)] = (ev.get("tid"), float(ev["ts"]))
            if ev.get("ph") != "X" or "dur" not in ev:
                continue
            name = ev.get("name", "")
            if kernels.is_gpu_event(ev):     # a kernel / copy on a GPU stream (CUDA runs only)
                kernel_rows.append({
                    "rank": rank, "name": name, "category": kernels.kernel_category(name),
                    "op": None, "bytes": None, "start_us": float(ev["ts"]), "base_ns": base_ns,
                    "dur_us": float(ev["dur"]), "thread": f"stream {ev.get('tid')}",
                    "correlation": kernels.correlation(ev)})
                continue
            cat = categorize(name)
            if cat == "op" and not include_ops:
                continue
            m = _COMM.match(name)
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
        kernels.label_kernels(kernel_rows, launches, labelled)
        for k in kernel_rows:
            k.pop("correlation")
        rows += kernel_rows
    df = pd.DataFrame(rows, columns=["rank", "name", "category", "op", "bytes", "start_us",
                                     "base_ns", "dur_us", "thread", "label", "label_id", "launch_us"])
    base_ns = df.pop("base_ns")
    if df.empty:
        return df.assign(step=pd.Series(dtype="Int64"))
    shifts = df["rank"].map(rank_clock_shifts(dict(zip(df["rank"], base_ns))))
    df["start_us"] += shifts
    df["launch_us"] = df["launch_us"].astype(float) + shifts
    origin = df["start_us"].min()
    df["start_us"] -= origin
    df["launch_us"] -= origin
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
    not computing). It is *communicating* if any comm range covers t. Exact: the timeline is cut at
    every range boundary and each piece is classified.
    """
    cuts = sorted({x for s, e, _ in phases + comms for x in (s, e)} | {x for w in windows for x in w})
    split = {"compute": 0.0, "comm": 0.0, "overlap": 0.0, "idle": 0.0}
    for left, right in zip(cuts, cuts[1:]):
        mid = (left + right) / 2
        if not any(s <= mid < e for s, e in windows):
            continue
        comm_threads = {t for s, e, t in comms if s <= mid < e}
        computing = any(s <= mid < e and t not in comm_threads for s, e, t in phases)
        key = ("overlap" if comm_threads else "compute") if computing else (
            "comm" if comm_threads else "idle")
        split[key] += right - left
    return split


def summarize(df):
    """Per rank, inside the profiled steps: time computing only, communicating only, both at once
    (communication hidden under compute), and neither (idle), in µs and as fractions of the step.

    `source` says what was read: "gpu kernels" when the rank's trace has GPU kernels (a CUDA run:
    NCCL kernels are communication, every other kernel compute; refimpl.trace.kernels), else
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
            ranges = {cat: [(r.start_us, r.start_us + r.dur_us, r.thread)
                            for r in g.itertuples() if r.category in cats]
                      for cat, cats in (("phase", PHASES), ("comm", ("comm",)))}
            split = _time_split(ranges["phase"], ranges["comm"], windows)
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
    them), not the CPU range's, which only times the launch.
    """
    gpu = df[(df.category == "gpu_comm") & df.label.fillna("").str.startswith("comm:")
             & df.step.notna()]
    if not gpu.empty:
        calls = gpu.groupby(["rank", "label_id"]).agg(label=("label", "first"),
                                                      dur_us=("dur_us", "sum")).reset_index()
        parsed = calls.label.str.extract(_COMM.pattern)
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
