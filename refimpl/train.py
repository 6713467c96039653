"""The one training loop every strategy plugs into.

    result = train_on_ranks(TrainConfig(strategy="single", steps=5))      # from a notebook
    python -m refimpl train --strategy single --steps 5 --json            # from a shell

The loop owns what is common: seeding, the deterministic global batch of each step, timing (median
after warm-up), memory accounting by category, the profiler, and the JSON-ready result. The
strategy (refimpl.strategy.Strategy) owns placement, the step and gathering the state back.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from refimpl import launch
from refimpl.compose import run_checkpoint
from refimpl.compose.optim_reshard import full_optimizer_state, load_optimizer_state, validate_optimizer_state
from refimpl.compose.shard_boxes import BoxedParts
from refimpl.compose.transforms import model_parallel, validate_model_parallel
from refimpl.config import RunContext, TrainConfig
from refimpl.faults import injected, lose_this_rank
from refimpl.memory import ActivationTracker
from refimpl.mesh import Mesh
from refimpl.model import build_model, converted, count_params, synthetic_batch
from refimpl.model.hf import HubState
from refimpl.model.moe import moe_step_record
from refimpl.numerics import deterministic_needed, exact_fp32_on_cuda
from refimpl.rank_model import RankModel
from refimpl.rank_values import RankValues
from refimpl.registry import Resolved, resolve
from refimpl.strategy import Strategy
from refimpl.trace.capture import StepProfiler, profiles_root
from refimpl.trace.memory_events import StepPeak
from refimpl.trace.run_record import record_run


def validate(cfg: TrainConfig) -> Resolved:
    """Every layout check, in the launching process: raises LayoutError with one line, or returns
    the layout resolved (refimpl.registry: the shorthand's axes filled, the strategy's class)."""
    layout = resolve(cfg)
    cfg = layout.cfg
    cfg.validate()
    validate_model_parallel(cfg, layout.strategy)
    layout.strategy.validate(cfg)
    if cfg.init_optimizer_state or cfg.return_optimizer_state:
        validate_optimizer_state(cfg)
    if cfg.checkpoint_dir:
        run_checkpoint.validate_checkpointing(cfg, layout.strategy)
    return layout


def default_trace_dir(cfg: TrainConfig) -> str:
    return str(profiles_root() / "cli" / f"{cfg.strategy}-n{cfg.nproc}")


def setup_rank(rank: int, world_size: int, layout: Resolved, resume: dict | None = None,
               placing=contextlib.nullcontext()) -> tuple[RunContext, Strategy, int]:
    """This rank's context, its strategy placed from the reference model (and a checkpoint, if
    any), and the reference's parameter count: everything before the first step. `layout`: the
    run's configuration resolved (refimpl.registry.resolve); `resume`: a run checkpoint
    (refimpl.compose.run_checkpoint) to continue, instead of init_state; `placing`: a context
    open while the strategy places the rank's tensors, the only part of this that allocates
    (the dry run's memory counter, refimpl.lab.verify.dryrun)."""
    cfg = layout.cfg
    backend, device = _backend_and_device(cfg)
    exact_fp32_on_cuda(device, deterministic_needed(device, cfg.dtype, cfg.mixed_precision,
                                                   cfg.return_state))
    # This rank's point of the grid and one process group per axis (refimpl.mesh).
    mesh = Mesh(cfg.dims, rank)
    ctx = RunContext(rank, world_size, backend, device, cfg, mesh)
    torch.manual_seed(cfg.seed)
    # The reference as shapes only (meta): no rank holds it whole (a 7B model is 25 GiB in fp32).
    # Each tensor a rank keeps gets its value as the strategy places it (refimpl.rank_values):
    # the seeded init `single` starts from too, or a checkpoint's. --dtype float64: every copy
    # and buffer below follows the reference's dtype.
    reference = converted(build_model(cfg.model, cfg.seed, device="meta"), dtype=ctx.param_dtype)
    state = None
    if resume is not None:
        state = resume.get("weights")     # a twin's (DCP) loads its weights after placing
    elif cfg.init_state is not None:
        # A checkpoint is the reference's full state dict, whatever strategy and world size wrote
        # it: every rank places its own part of it, so it reshards on load. Memory-mapped, so a
        # tensor is read from the file when it is placed, not all of them at once.
        state = torch.load(cfg.init_state, map_location="cpu", mmap=True)
    elif cfg.init_hf is not None:
        # a Hugging Face folder (Llama, Mixtral): each rank reads from the safetensors files the
        # slices it keeps (refimpl.model.hf.HubState, read by boxes)
        state = BoxedParts(HubState(cfg.init_hf, reference))
    values = RankValues(reference, cfg.seed, mesh, device, state)
    n_params = count_params(reference)
    strategy = layout.strategy(ctx)
    # The model-parallel transforms in their fixed order (refimpl.compose.transforms), on the
    # shapes, then the strategy's data-parallel placement, which gives them values. PyTorch's
    # DTensor twins parallelize the plain reference: it is made whole on the device for them.
    with placing:
        strategy.place(model_parallel(reference, ctx) if strategy.takes_our_transforms
                       else RankModel(reference), values)
    if resume is not None:                     # AdamW's state and the generator, as they were
        run_checkpoint.restore(strategy, resume)
    elif cfg.init_optimizer_state is not None:   # AdamW's m, v too, placed for this layout
        load_optimizer_state(strategy, torch.load(cfg.init_optimizer_state, map_location="cpu"))
    return ctx, strategy, n_params


def train_rank(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    """Train on this rank; run by `launch.run` on every rank (or once, for `single`). The name
    is resolved here, once per run: the axes a shorthand names, and the strategy's class."""
    return _train_resolved(rank, world_size, resolve(cfg))


def _train_resolved(rank: int, world_size: int, layout: Resolved) -> dict:
    cfg = layout.cfg
    resume = run_checkpoint.load_latest(cfg.checkpoint_dir)
    ctx, strategy, n_params = setup_rank(rank, world_size, layout, resume)
    device = ctx.device
    # Resumed: the data continues at the checkpoint's step, the losses before it are its own.
    first = resume["step"] if resume is not None else 0
    losses = list(resume["losses"]) if resume is not None else []

    step_times, activation_peak, moe_records = [], 0, []
    trace_dir = (cfg.trace_dir or default_trace_dir(cfg)) if cfg.profile else None
    peak = StepPeak(ctx.device, enabled=cfg.record_memory and not cfg.profile)
    with StepProfiler(trace_dir, rank, max(cfg.steps - first, 1), device=device) as profiler, peak:
        for step in range(first, cfg.steps):
            batch = synthetic_batch(cfg.model, cfg.global_batch, cfg.seq_len, cfg.seed, step)
            tracker = ActivationTracker(exclude=strategy.activation_exclusions())
            peak.step_begins(step)
            _sync(ctx)
            start = time.perf_counter()
            if injected(cfg, "rank-dies") and step == 1 and rank == 1:
                lose_this_rank(rank, world_size)        # the fault: a lost node, mid-run
            with tracker:
                loss = strategy.train_step(batch)
            _sync(ctx)
            step_times.append(time.perf_counter() - start)
            losses.append(float(loss))
            moe = moe_step_record(strategy.model)     # None for a dense model
            if moe is not None:
                moe_records.append(moe)
            activation_peak = max(activation_peak, tracker.peak)
            profiler.step()
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                run_checkpoint.save(strategy, step + 1, losses, cfg.checkpoint_dir)
    run_checkpoint.wait()       # the last save in flight is on disk before the run reports

    state = strategy.model_state()
    result = {
        "rank": rank,
        "losses": losses,
        "step_times": step_times,
        "n_params": n_params,
        "memory": {"params": int(state.params), "grads": int(state.grads),
                   "optimizer": int(state.optimizer), "activations_peak": int(activation_peak),
                   "total": int(state.total + activation_peak),
                   **peak.result(kept_bytes=int(state.total))},
        "trace_dir": trace_dir,
        "resumed_from": first,
    }
    if moe_records:   # MoE: per step, tokens per expert (routed, and received by this rank)
        result["moe"] = moe_records
    if cfg.return_state:
        result["state_dict"] = strategy.full_state_dict()
    if cfg.return_optimizer_state:
        result["optimizer_state"] = full_optimizer_state(strategy)
    if trace_dir is not None:   # traces are flushed: leave a summary and scalars beside them
        record_run(trace_dir, rank, world_size, cfg.strategy, result)
    return result


def train_on_ranks(cfg: TrainConfig, timeout: float = 900.0, quiet: bool = True,
                   stall: float | None = None) -> dict:
    """Validate, launch `cfg.nproc` ranks (or run in this process for nproc == 1), and merge.
    `stall`: refimpl.launch.run's hang watchdog (seconds all ranks wait in one call).

    Returns the CLI's JSON object, plus `per_rank` (each rank's raw result) and, with
    `cfg.return_state`, `state_dict` (rank 0's gathered copy).
    """
    validate(cfg)
    if launch.under_torchrun():
        # torchrun started one process per rank; each trains, then all exchange their results
        # so that every process can print the same merged JSON.
        (per_rank,) = launch.run(_train_rank_and_share, cfg.nproc, cfg)
    elif cfg.nproc == 1 and cfg.strategy == "single":
        per_rank = [in_this_process(train_rank, 0, 1, cfg)]   # the reference needs no group
    else:
        per_rank = launch.run(train_rank, cfg.nproc, cfg, timeout=timeout, quiet=quiet,
                              backend=launch_backend(cfg), stall=stall)
    return merge_results(cfg, per_rank)


def launch_backend(cfg: TrainConfig) -> str:
    """device "cpu" keeps the ranks on gloo even where there are GPUs enough for NCCL (the CPU
    planner check, refimpl.lab.plan.cpu); otherwise NCCL exactly when every rank gets a GPU."""
    return "gloo" if cfg.device == "cpu" else "auto"


def train_several_on_ranks(cfgs: list[TrainConfig], timeout: float = 900.0,
                           quiet: bool = True) -> list[dict]:
    """Several configurations, one after another, in one launch of the same ranks.

    A comparison (dp vs torch-ddp, ...) then pays the process start-up once, and its step times
    come from the same processes. All configurations must have the same `nproc`.
    """
    for cfg in cfgs:
        validate(cfg)
    if len({cfg.nproc for cfg in cfgs}) != 1:
        raise ValueError("train_several_on_ranks needs the same nproc for every configuration")
    if len({launch_backend(cfg) for cfg in cfgs}) != 1:
        raise ValueError("train_several_on_ranks needs every configuration on the same device")
    if launch.under_torchrun():
        runs = launch.run(_train_several, cfgs[0].nproc, cfgs)
    else:
        runs = launch.run(_train_several, cfgs[0].nproc, cfgs, timeout=timeout, quiet=quiet,
                          backend=launch_backend(cfgs[0]))
    return [merge_results(cfg, [rank_runs[i] for rank_runs in runs]) for i, cfg in enumerate(cfgs)]


def _train_several(rank: int, world_size: int, cfgs: list[TrainConfig]) -> list[dict]:
    results = [train_rank(rank, world_size, cfg) for cfg in cfgs]
    # Free the strategies' reference cycles (models, hooks, DDP reducers) now, while torch and the
    # process group are alive: left to the interpreter's exit they can abort the rank
    # ("terminate called without an active exception").
    gc.collect()
    return results


def in_this_process(fn, *args):
    """Run the reference here on one thread, as every rank runs: it does not fight the ranks of a
    comparison for the cores, and its matmuls sum in the same order as a rank's would."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _train_rank_and_share(rank: int, world_size: int, cfg: TrainConfig) -> list[dict]:
    import torch.distributed as dist

    mine = train_rank(rank, world_size, cfg)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def merge_results(cfg: TrainConfig, per_rank: list[dict]) -> dict:
    first = per_rank[0]
    # A step takes as long as its slowest rank; the median over steps after the first (warm-up).
    slowest = [max(times) for times in zip(*(r["step_times"] for r in per_rank))]
    timed = slowest[1:] if len(slowest) > 1 else slowest
    out = {
        "strategy": cfg.strategy,
        "world_size": cfg.nproc,
        "losses": first["losses"],
        # None only when a resumed run found nothing left to do (its checkpoint is its last step)
        "step_time_s": statistics.median(timed) if timed else None,
        "n_params": first["n_params"],
        "memory": [r["memory"] for r in per_rank],
        "trace_dir": first["trace_dir"],
        "per_rank": per_rank,
    }
    if cfg.checkpoint_dir:   # the step the run started from (0: no checkpoint was there)
        out["resumed_from"] = first["resumed_from"]
    if cfg.return_state:
        out["state_dict"] = first["state_dict"]
    if cfg.return_optimizer_state:
        out["optimizer_state"] = first["optimizer_state"]
    if "moe" in first:   # per rank, per step (refimpl.model.moe.moe_step_record)
        out["moe"] = [r["moe"] for r in per_rank]
    return out


def _backend_and_device(cfg: TrainConfig) -> tuple[str, torch.device]:
    """A rank computes where its backend puts it. The in-process run (no process group) computes
    on `cfg.device`: a reference sets it to its comparison's ranks' device (never straddling)."""
    import torch.distributed as dist

    if dist.is_initialized():
        backend = dist.get_backend()
        return backend, launch.device_for(backend)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return ("nccl", torch.device("cuda", 0)) if use_cuda else ("gloo", torch.device("cpu"))


def _sync(ctx: RunContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def train_several_recording_memory(cfgs, record_memory: list[bool], timeout: float = 900.0):
    """train_several_on_ranks with `record_memory` set where asked; each such result gains
    `transient_peak` (rank -> bytes), as notebooks 04-05 read it."""
    cfgs = [c.with_(record_memory=bool(m)) for c, m in zip(cfgs, record_memory, strict=True)]
    results = train_several_on_ranks(cfgs, timeout=timeout)
    for cfg, result in zip(cfgs, results):
        if cfg.record_memory:
            result["transient_peak"] = {r: m["transient_peak"]
                                        for r, m in enumerate(result["memory"])}
    return results
