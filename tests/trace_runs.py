"""Runs with traces, for the tests of the trace viewers (plugin, merged trace, scalars).

`profiled_allreduce` is a real multi-rank run on gloo: each step a forward and a backward of
different cost per rank (so the faster rank waits in the all-reduce: idle and comm to see), one
labelled all-reduce, an optimizer phase; then `record_run` as the training loop calls it.

`write_synthetic_run` writes Kineto-shaped traces without running anything, for sizes a real run
would take too long to produce in a test (4 ranks x 10 profiled steps).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

GRAD_NUMEL = 64 * 1024


def profiled_allreduce(rank: int, world_size: int, out: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from refimpl.lab.instrument.labels import comm_span, phase
    from refimpl.lab.trace.capture import StepProfiler
    from refimpl.lab.trace.run_record import record_run

    torch.manual_seed(rank)
    x = torch.randn(128 * (rank + 1), 128)     # rank r computes (r+1)x as much
    w = torch.randn(128, 128)
    grad = torch.zeros(GRAD_NUMEL)
    losses, step_times = [], []
    with StepProfiler(out, rank, steps, active=steps - 1) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            with phase("forward"):
                y = x @ w
            with phase("backward"):
                grad.add_((y @ w).sum())
                with comm_span("all_reduce", grad.numel() * grad.element_size()):
                    dist.all_reduce(grad)
            with phase("optimizer"):
                w.mul_(0.999)
            losses.append(float(y.mean()))
            step_times.append(time.perf_counter() - start)
            prof.step()
    result = {"losses": losses, "step_times": step_times, "n_params": w.numel(),
              "memory": {"params": w.numel() * 4, "grads": grad.numel() * 4, "optimizer": 0,
                         "activations_peak": y.numel() * 4, "total": (w.numel() + grad.numel()
                                                                      + y.numel()) * 4}}
    record_run(out, rank, world_size, "test-allreduce", result)
    return result


def make_run(out: Path, world_size: int = 2, steps: int = 4) -> list[dict]:
    from refimpl import launch

    return launch.run(profiled_allreduce, world_size, str(out), steps, timeout=120, quiet=True)


REAL_RUN, BIG_RUN = "nb/allreduce-n2", "nb/synthetic-n4"


def shared_logdir(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A logdir holding a real 2-rank, 4-step run (REAL_RUN) and a synthetic 4-rank, 10-step one
    (BIG_RUN), made once per test session (a launch costs seconds) and shared by the test modules
    that only read it. Returns the logdir and each rank's result of the real run."""
    root = tmp_path_factory.getbasetemp() / "trace-logdir"
    results = root / "allreduce-n2.results.json"
    if not results.exists():
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(make_run(root / REAL_RUN, world_size=2, steps=4)))
        write_synthetic_run(root / BIG_RUN, ranks=4, steps=10)
    return root, json.loads(results.read_text())


def write_synthetic_run(out: Path, ranks: int = 4, steps: int = 10, ops_per_step: int = 400,
                        base_ns: int = 1_790_000_000_000_000_000, base_skew_s: int = 0) -> Path:
    """Trace files shaped like the profiler's: ProfilerStep#n, phases, one labelled all-reduce and
    its gloo event per step, and `ops_per_step` aten-op events that the loader must read past.

    All ranks start their first step at the same instant. With `base_skew_s`, rank r's
    baseTimeNanoseconds is r * base_skew_s seconds later and its ts that much smaller (Kineto on
    one host writes one base for every process, but nothing promises it)."""
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        shift = -rank * base_skew_s * 1e6
        events, t = [], 1e6 + shift
        for step in range(1, steps + 1):
            step_start = t
            for phase, dur in (("forward", 300.0), ("backward", 600.0)):
                events.append(_x(phase, t, dur))
                for i in range(ops_per_step // 2):
                    events.append(_x("aten::mm", t + i * dur / ops_per_step, dur / ops_per_step))
                t += dur
            events.append(_x("comm:all_reduce 262144B", t, 200.0 + 50 * rank))
            events.append(_x("gloo:all_reduce", t + 10, 180.0, tid=2))
            t += 250.0 + 50 * rank
            events.append(_x("optimizer", t, 100.0))
            t += 150.0                                  # 50 µs idle at the end of every step
            events.append(_x(f"ProfilerStep#{step}", step_start, t - step_start))
        trace = {"schemaVersion": 1, "baseTimeNanoseconds": base_ns + rank * base_skew_s * 10**9,
                 "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": ranks},
                 "traceEvents": [{"ph": "M", "name": "process_name", "pid": 100 + rank, "tid": 0,
                                  "args": {"name": "python"}}] + events}
        (out / f"rank{rank}.{1000 + rank}.pt.trace.json").write_text(json.dumps(trace))
    return out


def _x(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 100, "tid": tid,
            "ts": ts, "dur": dur}
