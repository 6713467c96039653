"""What a profiled run leaves beside its traces, for viewers that are not the profiler plugin.

    record_run(trace_dir, rank, world_size, strategy, result)     # called once per rank by the loop

writes into the run folder, from rank 0:

* `run_summary.json`: strategy, world size, losses, every rank's step times and memory by category
  (params, grads, optimizer, activations_peak, total). The trace plugin draws memory from it.
* TensorBoard scalars (`events.out.tfevents.*.refimpl`), so TensorBoard's own Scalars dashboard,
  which needs no network, shows the run too:
    loss                          rank 0's view of the global loss, per step
    time/step_ms                  rank 0's step time, per step
    memory/rank<r>/<category>     bytes; model state does not change between steps, and
                                  activations_peak is the run's peak, so each is one value per step
    comm/fraction/rank<r>         share of each profiled step in which rank r communicates
    comm/exposed_fraction/rank<r> ... in which it communicates and does not compute (what overlap
                                  did not hide)

Why rank 0 writes everything: every rank's trace is flushed when its profiler exits, and
`all_gather_object` below returns only when every rank has got there, so rank 0 can then read all
traces, and one writer means one event file per run (TensorBoard reads several event files in one
folder as one run, but a rerun's file would then draw over the last one; ours replaces it).
"""
from __future__ import annotations

import json
from pathlib import Path

from refimpl.lab.trace.profiling import load_trace
from refimpl.lab.trace.views import step_breakdown

SUMMARY_NAME = "run_summary.json"
EVENT_SUFFIX = ".refimpl"


def record_run(trace_dir: str | Path, rank: int, world_size: int, strategy: str,
               result: dict) -> None:
    """Gather every rank's losses, step times and memory; rank 0 writes the summary and scalars.

    Every rank must call this (it is a collective when world_size > 1), after its profiler exited.
    """
    mine = {"losses": result["losses"], "step_times": result["step_times"],
            "memory": result["memory"]}
    everyone = _gather(mine, world_size)
    if rank != 0:
        return
    summary = {
        "strategy": strategy,
        "world_size": world_size,
        "n_params": result.get("n_params"),
        "losses": everyone[0]["losses"],
        "step_times": [r["step_times"] for r in everyone],
        "memory": [r["memory"] for r in everyone],
    }
    run = Path(trace_dir)
    write_run_summary(run, summary)
    write_scalars(run, summary)


def write_run_summary(run: Path, summary: dict) -> Path:
    path = run / SUMMARY_NAME
    path.write_text(json.dumps(summary, indent=1))
    return path


def read_run_summary(run: str | Path) -> dict | None:
    """The run's summary, or None for a run not written by the training loop."""
    path = Path(run) / SUMMARY_NAME
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write_scalars(run: Path, summary: dict) -> Path:
    """One event file of per-step scalars in the run folder, replacing a previous run's."""
    from torch.utils.tensorboard import SummaryWriter

    for old in run.glob(f"events.out.tfevents.*{EVENT_SUFFIX}"):
        old.unlink()
    writer = SummaryWriter(log_dir=str(run), filename_suffix=EVENT_SUFFIX)
    try:
        for step, loss in enumerate(summary["losses"]):
            writer.add_scalar("loss", loss, step)
        for step, seconds in enumerate(summary["step_times"][0]):
            writer.add_scalar("time/step_ms", seconds * 1e3, step)
        steps = len(summary["losses"])
        for rank, mem in enumerate(summary["memory"]):
            for category, nbytes in mem.items():
                if nbytes is None:            # a peak not measured in this run (under --profile)
                    continue
                for step in range(steps):
                    writer.add_scalar(f"memory/rank{rank}/{category}", nbytes, step)
        for row in comm_fractions(run, summary["world_size"]):
            writer.add_scalar(f"comm/fraction/rank{row['rank']}", row["fraction"], row["step"])
            writer.add_scalar(f"comm/exposed_fraction/rank{row['rank']}", row["exposed"],
                              row["step"])
    finally:
        writer.close()
    return next(run.glob(f"events.out.tfevents.*{EVENT_SUFFIX}"))


def comm_fractions(run: Path, world_size: int) -> list[dict]:
    """Per profiled step and rank: the share of the step spent communicating (hidden or not) and
    the share spent communicating while not computing, from the traces."""

    df = load_trace(run)
    if df.empty:
        return []
    df = df[df["rank"] < world_size]   # a folder reused by a larger run may hold extra ranks
    per_step = step_breakdown(df)
    return [{"step": int(r.step), "rank": int(r.rank),
             "fraction": float(r.comm_frac + r.overlap_frac), "exposed": float(r.comm_frac)}
            for r in per_step.itertuples()]


def _gather(obj: dict, world_size: int) -> list[dict]:
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world_size
    dist.all_gather_object(out, obj)
    return out
