"""GPU kernels in a torch.profiler trace: which are communication, what launched them, and how the
GPU's time splits into compute, communication, both and neither.

Why a second reading. On CPU ranks (gloo) a collective runs on CPU threads, and our labelled
`record_function` ranges time the work itself. Under CUDA the CPU only *launches*: `forward` on the
CPU ends long before its kernels finish, and a `comm:all_reduce` range times the enqueue of an NCCL
kernel, not the transfer. The truth is on the GPU's streams, which the profiler records (with
CUPTI) as events of category `kernel` (and `gpu_memcpy` / `gpu_memset`), each carrying a
`correlation` id equal to that of the CPU-side `cudaLaunchKernel` (category `cuda_runtime` or
`cuda_driver`) that launched it. So:

  * a kernel is communication if it is NCCL's (`ncclDevKernel_AllReduce_Sum_f32_RING_LL`,
    `ncclKernel_...`), compute otherwise (memcpy and memset count as the GPU being busy) -- except
    the staged backend's copies: on a GPU, refimpl.lab.runtime.shared_device moves each collective's and
    message's tensors to the host and back inside a `staged:copy` range (`STAGING_COPY`), and a
    copy launched inside one on its thread is communication (`mark_staging_copies`). gloo's own
    time between the two copies runs on the host: the GPU's streams show it as idle;
  * its label is the innermost of our CPU ranges (phase or `comm:<op>`) that was open on the
    launching thread at the launch, found through the correlation id; if that thread had none of
    our ranges open, the innermost phase open on the rank's other threads at that moment. Why:
    on CUDA, autograd runs backward on its own device thread, so `phase("backward")` and the
    `pp:B`/`pp:W` ranges are open on the main thread while every backward kernel is launched from
    another (a real DDP trace, tests/data/hta_nccl, launches most of its kernels so). A
    `comm:<op>` range never claims another thread's kernels: a collective's kernels are launched
    by the thread that issues it;
  * its step is the step the launch happened in (the loop synchronizes the GPU before a step
    ends, so every kernel also runs inside its step's window).

An NCCL kernel's time includes waiting for the slowest peer (it spins until the data arrives), the
same convention HolisticTraceAnalysis uses; "comm" time on a GPU is therefore "NCCL kernel
resident", which is what a compute kernel could have overlapped with.
"""
from __future__ import annotations

import bisect
import re

from refimpl.lab.instrument.labels import categorize

GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STAGING_COPY = "staged:copy"   # refimpl.lab.runtime.shared_device.STAGING_RANGE: its host<->device copies
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
_NCCL = re.compile(r"nccl", re.IGNORECASE)


def is_gpu_event(ev: dict) -> bool:
    return ev.get("ph") == "X" and ev.get("cat") in GPU_EVENT_CATEGORIES


def is_launch(ev: dict) -> bool:
    return ev.get("cat") in LAUNCH_CATEGORIES and "correlation" in ev.get("args", {})


def kernel_category(name: str) -> str:
    """"gpu_comm" for NCCL's kernels, "gpu" for everything else that runs on the device."""
    return "gpu_comm" if _NCCL.search(name) else "gpu"


def mark_staging_copies(kernels: list[dict], launches: dict, staging: list[tuple]) -> None:
    """Set "gpu_comm" on each GPU event launched inside a `STAGING_COPY` range on the launching
    thread: the staged backend's copies to the host and back are its communication, not compute.

    kernels: rows with "correlation" and "category"; launches: correlation -> (thread, ts);
    staging: (thread, start, end) of the ranges (they do not nest: one per staged call)."""
    by_thread: dict = {}
    for tid, start, end in sorted(staging, key=lambda r: r[1]):
        by_thread.setdefault(tid, []).append((start, end))
    starts = {tid: [s for s, _ in rs] for tid, rs in by_thread.items()}
    for k in kernels:
        launch = launches.get(k.get("correlation"))
        if launch is None or launch[0] not in by_thread:
            continue
        tid, ts = launch
        i = bisect.bisect_right(starts[tid], ts) - 1
        if i >= 0 and ts < by_thread[tid][i][1]:
            k["category"] = "gpu_comm"


def correlation(ev: dict):
    return ev.get("args", {}).get("correlation")


def label_kernels(kernels: list[dict], launches: dict, labelled: list[tuple]) -> None:
    """Set each kernel row's "label", "label_id" and "launch_us" in place.

    kernels: rows with a "correlation"; launches: correlation -> (thread, ts) of the CPU launch;
    labelled: (thread, start, end, name) of our CPU ranges (phases, comm:<op>, backends' ops).
    label_id numbers the CPU range (one id per call: a collective rebuilt from send/recv launches
    several NCCL kernels under one `comm:<op>` range). A kernel whose launch is not in the trace
    (CUPTI dropped it) keeps label None.
    """
    ordered = sorted(labelled, key=lambda r: r[1])
    ranges = [(tid, s, e, name, i, categorize(name) == "comm") for i, (tid, s, e, name)
              in enumerate(ordered)]
    index = _ThreadIndex(ranges)
    for k in kernels:
        launch = launches.get(k.get("correlation"))
        k["label"], k["label_id"], k["launch_us"] = None, None, None
        if launch is None:
            continue
        tid, ts = launch
        k["launch_us"] = ts
        # innermost open range = the latest-starting one that still covers ts
        for _, _, _, name, label_id, _ in reversed(index.covering(tid, ts)):
            k["label"], k["label_id"] = name, label_id
            break


def gpu_spans(kernels: list[dict], launches: dict, ranges: list[tuple]) -> dict[int, tuple[float, float]]:
    """The GPU time of CPU ranges: index -> (first start, last end) of the kernels launched while
    the range was open on its thread, or on a thread with none of these ranges open (autograd's
    device thread: _ThreadIndex) (nested ranges each count their kernels; a range that launched
    none is absent).

    ranges: (thread, start, end, comm) per CPU range. A communication range spans all its kernels;
    any other range (a phase, a pipeline action `pp:F3`) only its compute kernels, because an NCCL
    kernel launched inside an action spins until the peer's data arrives: that wait is the
    pipeline's bubble, not the action's work. This is how notebook 07 reads a CUDA run's actions
    off the GPU's own timeline: Kineto's `gpu_user_annotation` events give the same spans per
    stream (tests/test_gpu_trace.py checks the two agree on a real trace), but only for ranges it
    chose to annotate.
    """
    index = _ThreadIndex([(tid, s, e, None, i, comm) for i, (tid, s, e, comm) in enumerate(ranges)])
    spans: dict[int, tuple[float, float]] = {}
    for k in kernels:
        launch = launches.get(k.get("correlation"))
        if launch is None:
            continue
        start, end = k["start_us"], k["start_us"] + k["dur_us"]
        is_comm = k["category"] == "gpu_comm"
        for _, _, _, _, i, comm in index.covering(*launch):
            if comm or not is_comm:
                old = spans.get(i, (start, end))
                spans[i] = (min(old[0], start), max(old[1], end))
    return spans


class _ThreadIndex:
    """Which of a rank's CPU ranges a launch at (thread, ts) falls in: those open on the launching
    thread; if none is open there (autograd's device thread, see the module docstring), the
    non-communication ranges open on the rank's other threads. Rows are (thread, start, end,
    name, index, comm); `covering` returns the matches in order of start."""

    def __init__(self, rows: list[tuple]):
        self.rows = sorted(rows, key=lambda r: r[1])
        self.by_thread: dict = {}
        for r in self.rows:
            self.by_thread.setdefault(r[0], []).append(r)
        self.starts = {tid: [r[1] for r in rs] for tid, rs in self.by_thread.items()}
        self.all_starts = [r[1] for r in self.rows]

    def covering(self, tid, ts: float) -> list[tuple]:
        own = self.by_thread.get(tid, [])
        found = [r for r in own[:bisect.bisect_right(self.starts.get(tid, []), ts)] if ts < r[2]]
        if found:
            return found
        return [r for r in self.rows[:bisect.bisect_right(self.all_starts, ts)]
                if ts < r[2] and r[0] != tid and not r[5]]


def split_busy_time(compute: list[tuple], comm: list[tuple], windows: list[tuple]) -> dict:
    """Time inside `windows` with only compute busy, only comm busy, both, and neither (µs).

    A sweep over sorted interval ends, O(n log n): a GPU step has thousands of kernels.
    Intervals are (start, end); windows must not overlap each other.
    """
    events = []
    for s, e in compute:
        events += [(s, 0, 1), (e, 0, -1)]
    for s, e in comm:
        events += [(s, 1, 1), (e, 1, -1)]
    events.sort(key=lambda x: (x[0], x[2]))           # at equal times close before open
    times = [t for t, _, _ in events]
    split = {"compute": 0.0, "comm": 0.0, "overlap": 0.0, "idle": 0.0}
    for w0, w1 in windows:
        active = [0, 0]
        # state at w0: every interval opened before w0 and not yet closed
        first = bisect.bisect_right(times, w0)
        for _, kind, d in events[:first]:
            active[kind] += d
        t = w0
        for when, kind, d in events[first:] + [(w1, None, 0)]:
            when = min(when, w1)
            if when > t:
                _add(split, active, when - t)
                t = when
            if kind is None or when >= w1:
                break
            active[kind] += d
    return split


def _add(split: dict, active: list, dt: float) -> None:
    c, m = active[0] > 0, active[1] > 0
    split["overlap" if c and m else "compute" if c else "comm" if m else "idle"] += dt
