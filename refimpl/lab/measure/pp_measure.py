"""The bubble and the activation memory of a real pipeline run, against what the tables predict.

    rows = launch.run(profile_pipeline, 2, cfg, "1f1b", 8, trace_dir=run)    # on each rank
    slots = action_slots(load_trace(run, include_ops=True))                  # every F/B/W range
    measured_bubble(slots)     vs bubble_fraction(...) and simulate(table, per-rank durations)

Bubble. Each action runs inside a `pp:F3` range (refimpl.parallel.pp.runner); a rank waiting for a
neighbour is outside every such range. Per profiled step the measured idle share is
1 - (sum of action times) / (ranks x (last end - first start)), the same definition that
`simulate.idle_fraction` applies to a replayed table: the closed form assumes every stage costs
the same; `simulated_bubble_from` replays the table with each rank's *measured* mean F, B, W times,
so stage imbalance (embedding on the first, head and loss on the last) is in the prediction too;
`measured_costs` adds what every action and message costs outside the compute on the same run (an
empty action's gap, a message's alpha), which the closed form and the plain replay lack.

Activations. Saved-for-backward bytes are counted per rank with refimpl.lab.instrument.activations.ActivationTracker. A stage
holds the activations of every micro-batch in flight (F done, backward not yet), so the prediction
is (peak in-flight of its row of the table) x (bytes one forward of the stage saves). For zb-h1 the
tracker sees only what autograd saves: the layer inputs and output gradients that pp.zero_bubble
keeps from B until W are not autograd's and are not in its count.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from refimpl.lab.instrument.activations import ActivationTracker
from refimpl.lab.pipeline.posting import chosen_links
from refimpl.lab.pipeline.simulate import TimedAction, dependencies, flat, idle_fraction, simulate
from refimpl.lab.trace.capture import StepProfiler
from refimpl.launch import device_for
from refimpl.model import GPTConfig, build_model, lm_loss, synthetic_batch
from refimpl.parallel.pp.runner import run_schedule
from refimpl.parallel.pp.schedules import (
    PAIR,
    Action,
    chunks_per_rank,
    placement,
    rank_of,
    schedule_table,
)
from refimpl.parallel.pp.stage import build_chunks


def profile_pipeline(rank: int, world: int, cfg: GPTConfig, schedule: str, micro_batches: int, *,
                     virtual_stages: int = 1, global_batch: int = 16, seq_len: int | None = None,
                     steps: int = 3, trace_dir: str | None = None, seed: int = 0) -> dict:
    """One rank of a pipeline run: `steps` steps of the schedule (the first is warm-up), profiled
    into `trace_dir` when given. Returns this rank's loss, median step time, the peak activation
    bytes of a step and the bytes one micro-batch's forward saves on this stage."""
    group = dist.new_group(list(range(world)))
    seq = seq_len or cfg.seq_len
    v, where = chunks_per_rank(schedule, virtual_stages), placement(schedule)
    device = device_for(dist.get_backend())     # the rank's GPU under NCCL: it refuses CPU tensors
    chunks = build_chunks(build_model(cfg, seed).to(device), world, rank, v, where=where)
    params = [p for c in chunks for p in c.parameters()]
    table = schedule_table(world, micro_batches, schedule, v)
    times, peaks, loss = [], [], None
    with StepProfiler(trace_dir, rank, steps, device=device) as prof:
        for step in range(steps):
            batch = synthetic_batch(cfg, global_batch, seq, seed, step).to(device)
            micro = batch.micro_batches(micro_batches)
            dist.barrier(group)     # start every rank's step together: the bubble is then the schedule's
            start = time.perf_counter()
            with ActivationTracker(exclude=params) as tracker:
                loss = run_schedule(chunks, table, micro, group, where=where, links=chosen_links())
            dist.barrier(group)
            times.append(time.perf_counter() - start)
            peaks.append(tracker.peak)
            for p in params:
                p.grad = None
            prof.step()
    return {"rank": rank, "loss": loss, "step_time_s": statistics.median(times[1:] or times),
            "activation_peak": max(peaks),
            "per_micro_batch": _one_forward_bytes(chunks, world, rank, micro[0], group)}


def _one_forward_bytes(chunks, world, rank, mb, group) -> list[int]:
    """Bytes saved by one micro-batch's forward of each chunk (fed a stand-in input of the right
    shape: what is saved depends on shapes only)."""
    out = []
    for chunk in chunks:
        params = list(chunk.parameters())
        x = mb.inputs if chunk.is_first else torch.zeros(
            *mb.inputs.shape, chunk.d_model, device=mb.inputs.device, requires_grad=True)
        with ActivationTracker(exclude=params) as tracker:
            y = chunk(x)
            if chunk.is_last:
                y = lm_loss(y, mb.targets)
        out.append(tracker.peak)
        del y
    return out


def predicted_activation_peak(row: list[str], per_micro_batch: list[int]) -> int:
    """Peak in-flight micro-batches of each chunk x that chunk's bytes per micro-batch. For one chunk
    per rank this is in-flight x bytes; for interleaved the chunks' in-flight counts are replayed
    together and the largest sum taken."""
    held, peak = [0] * len(per_micro_batch), 0
    for a in map(Action.parse, flat(row)):
        held[a.chunk] += {"F": 1, "B": -1, "W": 0}[a.kind]
        peak = max(peak, sum(h * b for h, b in zip(held, per_micro_batch)))
    return peak


# An action's range ("pp:F3", "pp:B1.0"); not the wait for its message ("pp:F3 recv", refimpl.parallel.pp.links).
ACTION_RANGE = r"^pp:[FBW]\d+(?:\.\d+)?$"


def action_slots(df):
    """From `load_trace(run, include_ops=True)`: one row per pipeline action per profiled step,
    columns step, rank, action, start, end (ms from the step's first action on any rank).

    Which clock: on CPU ranks an action's `pp:` range times its work. On a CUDA run the range only
    times the kernel launches and NCCL's wait does not block the host, so the action is read off
    the GPU's own timeline instead: the compute kernels it launched (refimpl.lab.trace.kernels
    .gpu_spans, through the correlation ids). `slots.attrs["clock"]` says which was read."""
    acts = df[df["name"].str.match(ACTION_RANGE) & df["step"].notna()].copy()
    on_gpu = "gpu_start_us" in acts and acts["gpu_start_us"].notna().any()
    if on_gpu:
        acts = acts[acts["gpu_start_us"].notna()]
        acts["start_us"], acts["dur_us"] = acts["gpu_start_us"], acts["gpu_dur_us"]
    acts["action"] = acts["name"].str[3:]
    first = acts.groupby("step")["start_us"].transform("min")
    acts["start"] = (acts["start_us"] - first) / 1e3
    acts["end"] = (acts["start_us"] + acts["dur_us"] - first) / 1e3
    slots = acts[["step", "rank", "action", "start", "end"]].reset_index(drop=True)
    slots.attrs["clock"] = "gpu kernels" if on_gpu else "cpu ranges"
    return slots


def measured_bubble(slots) -> float:
    """Median over the profiled steps of the idle share (the definition of simulate.idle_fraction)."""
    shares = [idle_fraction([TimedAction(r.rank, r.action, r.start, r.end) for r in g.itertuples()])
              for _, g in slots.groupby("step")]
    return statistics.median(shares)


def mean_durations(slots) -> list[dict]:
    """Per rank, the mean time of its F, B and W actions (ms): the simulator's per_rank input."""
    kinds = slots.assign(kind=slots["action"].str[0], dur=slots["end"] - slots["start"])
    means = kinds.groupby(["rank", "kind"])["dur"].mean()
    return [{k: float(means[r][k]) for k in means[r].index} for r in sorted(slots["rank"].unique())]


def simulated_bubble_from(slots, stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1,
                          costs: dict | None = None) -> float:
    """The table replayed with each rank's measured mean F, B, W times; with `costs`
    (measured_costs: per action, per message) also what each action and message costs outside the
    compute, which neither the closed form nor the plain replay has."""
    table = schedule_table(stages, micro_batches, schedule, virtual_stages)
    return idle_fraction(simulate(table, F=0, B=0, W=0, per_rank=mean_durations(slots),
                                  where=placement(schedule), **(costs or {})))


def replayed_steps(slots, stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1,
                   costs: dict | None = None) -> list[dict]:
    """Per profiled step, the measured idle share beside the table replayed with *that step's*
    durations, action by action (and `costs`: measured_costs). Mean durations lose the spread:
    one action that runs long (a rank that lost its core for a while, a slow allocation) makes
    its neighbour wait, and a replay with means has no such wait. With each action's own time the
    replay differs from the run only by what the model leaves out: the order is the table's, the
    waits are the dependencies', so the remaining gap is the cost of messages and dispatch."""
    table = schedule_table(stages, micro_batches, schedule, virtual_stages)
    out = []
    for step, g in slots.groupby("step"):
        out.append({"step": step, "measured": idle_fraction(
            [TimedAction(r.rank, r.action, r.start, r.end) for r in g.itertuples()]),
            "replayed": idle_fraction(replay_step(g, table, schedule, costs))})
    return out


def replay_step(step_slots, table, schedule: str, costs: dict | None = None) -> list[TimedAction]:
    """One profiled step's table replayed with each action's own measured duration (and `costs`:
    measured_costs): where the run and the replay then differ, it is by the gaps alone."""
    own = {(r.rank, r.action): r.end - r.start for r in step_slots.itertuples()}
    return simulate(table, F=0, B=0, W=0, per_rank=mean_durations(step_slots), where=placement(schedule),
                    per_action=own, **(costs or {}))


def measured_costs(slots, stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1) -> dict:
    """From the same run, the three costs outside compute that simulate() takes (ms, as the slots):
      * `action_cost`, the mean gap between two actions of a rank when the second needs nothing
        from another rank (an empty action: Python dispatch, posting, bookkeeping);
      * `recv_cost`, the mean extra gap, over action_cost, before an action whose message from
        another rank had arrived before the rank was free for it: completing a receive that
        needed no waiting (its wait() call, the copy out of gloo's buffer, making the stage input
        a leaf); the interleaved and split schedules, whose actions mostly take a message, pay it
        on most actions;
      * `comm`, the mean time from a sender's action end to the receiver's start when the
        receiver was already waiting for it, less one action_cost (a message's alpha: the isend,
        gloo's transfer, the wait's wake-up).
    Means, not medians: the bubble is a sum of such gaps, and a median drops the long ones (a
    receive posted while the link is busy: runner's `post_receives`) that the sum contains. The
    F&B pair (dualpipev) is one entry: its gap is the first action's, its messages both actions'
    (the pair waits for them before it starts), and its second action is left out (the simulator
    charges it action_cost only)."""
    where = placement(schedule)
    table = schedule_table(stages, micro_batches, schedule, virtual_stages)
    n_virtual = stages * (1 + max(a.chunk for row in table for a in map(Action.parse, flat(row))))
    entry = {(r, e.split(PAIR)[0]): [Action.parse(t) for t in e.split(PAIR)] for r, row in enumerate(table)
             for e in row}
    empty, collected, message = [], [], []
    for _, g in slots.groupby("step"):
        end = {(r.rank, r.action): r.end for r in g.itertuples()}
        for rank, rows in g.sort_values("start").groupby("rank"):
            prev = None
            for r in rows.itertuples():
                if (rank, r.action) not in entry:      # the second action of a pair
                    prev = r.end
                    continue
                deps = [d for a in entry[rank, r.action] for d in dependencies(a, rank, stages, n_virtual, where)
                        if rank_of(d[2], stages, where) != rank]
                if prev is not None and not deps:
                    empty.append(r.start - prev)
                sent = [end.get((rank_of(piece, stages, where),
                                 _text(kind, mb, piece, stages, where, "." in table[0][0])))
                        for kind, mb, piece in deps]
                if prev is not None and sent and None not in sent:
                    if max(sent) > prev:          # the rank was free first: it waited
                        message.append(r.start - max(sent))
                    else:                         # the message was there first: collected
                        collected.append(r.start - prev)
                prev = r.end
    cost = statistics.mean(empty) if empty else 0.0
    extra = lambda gaps: max(0.0, statistics.mean(gaps) - cost) if gaps else 0.0   # noqa: E731
    return {"action_cost": cost, "recv_cost": extra(collected), "comm": extra(message)}


def _text(kind, mb, piece, p, where, chunked):
    """The slot name of action (kind, mb) of `piece`, on the rank that holds it."""
    chunk = (0 if piece < p else 1) if where == "v" else piece // p
    return Action(kind, mb, chunk).text(chunked)


def run_each(rank: int, world: int, fn, calls: list[tuple]) -> list:
    """fn(rank, world, *args, **kwargs) for each (args, kwargs) in `calls`, on the same ranks: one
    launch (process start-up costs seconds) for a whole sweep."""
    return [fn(rank, world, *args, **kwargs) for args, kwargs in calls]
