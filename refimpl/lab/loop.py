"""The lab's additions to the one loop (refimpl.train), through refimpl.loop_extras: the shard-only
build (refimpl.lab.rank_build.shard_only), run checkpoints (save every K steps, resume), an initial
state (--init-state, --init-hf, --init-optimizer-state), the full state dict (--return-state), the
profiler's traces and a run record beside them, each step's time, the memory a rank holds and
the step's transient peak, MoE records, and AdamW's gathered state. Registered under the entry-point group "refimpl.loop" (pyproject.toml).
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from refimpl import launch, process_group, train
from refimpl.config import TrainConfig
from refimpl.lab.checkpoint import run_checkpoint
from refimpl.lab.checkpoint.export import export_state
from refimpl.lab.checkpoint.full_state import full_state_dict
from refimpl.lab.checkpoint.hf import HubState
from refimpl.lab.checkpoint.optim_reshard import (
    full_optimizer_state,
    load_optimizer_state,
    validate_optimizer_state,
)
from refimpl.lab.checkpoint.shard_boxes import BoxedParts
from refimpl.lab.config import lab_config
from refimpl.lab.instrument.activations import ActivationTracker, activation_exclusions
from refimpl.lab.instrument.layer_ranges import label_layers
from refimpl.lab.instrument.model_state import model_state
from refimpl.lab.layout_rules import check_run
from refimpl.lab.measure.moe_traffic import meter_experts, moe_step_record
from refimpl.lab.moe_scope import batch_scope_problem
from refimpl.lab.rank_build.shard_only import place_shards
from refimpl.lab.runtime.lane import refuse_on_nccl
from refimpl.lab.trace.capture import StepProfiler, profiles_root
from refimpl.lab.trace.memory_events import StepPeak
from refimpl.lab.trace.run_record import record_run
from refimpl.loop_extras import LoopExtras
from refimpl.mesh import LayoutError


def setup_rank(rank: int, world_size: int, layout, placing=contextlib.nullcontext()):
    """refimpl.train.setup_rank as the CLI's loop runs it: the shard-only build, from the lab's
    initial state, and what is placed after it (a run checkpoint's optimizer, --init-state,
    --init-hf, --init-optimizer-state). `placing`: open while the rank's tensors are made."""
    extras = LabExtras(layout.cfg, rank, world_size)
    extras.placing = placing
    return train.setup_rank(rank, world_size, layout, extras.place)


def default_trace_dir(cfg) -> str:
    return str(profiles_root() / "cli" / f"{cfg.strategy}-n{cfg.nproc}")


class LabExtras(LoopExtras):
    placing = contextlib.nullcontext()      # open while the rank's tensors are made (the dry run)

    def __init__(self, cfg, rank: int, world_size: int):
        super().__init__(lab_config(cfg), rank, world_size)     # self.cfg: a LabConfig

    @staticmethod
    def validate(cfg, strategy_class) -> None:
        cfg = lab_config(cfg)
        check_run(cfg, strategy_class)     # the rules every run keeps, before the lab's own
        if cfg.init_optimizer_state or cfg.return_optimizer_state or cfg.save_optimizer_state:
            validate_optimizer_state(cfg)
        if cfg.checkpoint_dir:
            run_checkpoint.validate_checkpointing(cfg, strategy_class)
        problem = batch_scope_problem(cfg.model, dp=cfg.dims.dp, cp=cfg.cp,
                                      micro_batches=cfg.micro_batches)
        if problem:
            raise LayoutError(problem)
        refuse_on_nccl(cfg)         # refimpl.comm's lane runs on gloo only

    def place(self, strategy) -> int:
        """The rank built shard by shard from `start`'s state, then given what `placed` adds."""
        n_params = place_shards(strategy, self.start, self.placing)
        self.placed(strategy)
        return n_params

    def start(self, reference):
        """A run checkpoint to continue (the data at its step, its losses), else a full state dict
        (memory-mapped: a tensor is read when placed) or a Hugging Face folder (read by boxes)."""
        cfg = self.cfg
        self.resume = run_checkpoint.load_latest(cfg.checkpoint_dir)
        if self.resume is not None:      # a twin's (DCP) loads its weights after placing
            self.first, self.losses = self.resume["step"], tuple(self.resume["losses"])
            return self.resume.get("weights")
        if cfg.init_state is not None:
            return torch.load(cfg.init_state, map_location="cpu", mmap=True)
        if cfg.init_hf is not None:
            return BoxedParts(HubState(cfg.init_hf, reference))
        return None

    def placed(self, strategy) -> None:
        if self.resume is not None:                     # AdamW's state and the generator
            run_checkpoint.restore(strategy, self.resume)
        elif self.cfg.init_optimizer_state is not None:   # AdamW's m, v, placed for this layout
            load_optimizer_state(strategy, torch.load(self.cfg.init_optimizer_state,
                                                      map_location="cpu"))

    @contextlib.contextmanager
    def steps(self, ctx, strategy, first: int):
        cfg = self.cfg
        self.moe, self.device, self.step_times, self.activation_peak = [], ctx.device, [], 0
        meter_experts(strategy.model)      # the all-to-all bytes of moe_step_record
        label_layers(strategy.model)       # tp:blocks.<i>.attn / .mlp ranges in the trace
        self.trace_dir = (cfg.trace_dir or default_trace_dir(cfg)) if cfg.profile else None
        self.peak = StepPeak(ctx.device, enabled=cfg.record_memory and not cfg.profile)
        with StepProfiler(self.trace_dir, self.rank, max(cfg.steps - first, 1),
                          device=ctx.device) as profiler, self.peak:
            self.peak.step_begins(first)

            def on_step(step: int, losses: list[float]) -> None:
                record = moe_step_record(strategy.model)     # None for a dense model
                if record is not None:
                    self.moe.append(record)
                profiler.step()
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    run_checkpoint.save(strategy, step + 1, losses, cfg.checkpoint_dir)
                self.peak.step_begins(step + 1)

            yield on_step
        run_checkpoint.wait()       # the last save in flight is on disk before the run reports

    @contextlib.contextmanager
    def measure_step(self, strategy):
        """The step's time (its device's queued work done at both ends) and the bytes autograd saved."""
        tracker = ActivationTracker(exclude=activation_exclusions(strategy))
        sync(self.device)
        begin = time.perf_counter()
        with tracker:
            yield
        sync(self.device)
        self.step_times.append(time.perf_counter() - begin)
        self.activation_peak = max(self.activation_peak, tracker.peak)

    def finish(self, strategy, result: dict) -> None:
        if self.cfg.return_state:
            result["state_dict"] = full_state_dict(strategy)
        state, peak = model_state(strategy), self.activation_peak
        result["step_times"] = self.step_times
        result["memory"] = {"params": int(state.params), "grads": int(state.grads),
                            "optimizer": int(state.optimizer), "activations_peak": int(peak),
                            "total": int(state.total + peak)}
        result["memory"].update(self.peak.result(kept_bytes=int(state.total)))
        result["trace_dir"] = self.trace_dir
        result["resumed_from"] = self.first
        if self.moe:   # MoE: per step, tokens per expert (routed, and received by this rank)
            result["moe"] = self.moe
        if self.cfg.return_optimizer_state:
            result["optimizer_state"] = full_optimizer_state(strategy)
        if self.cfg.save_state or self.cfg.save_optimizer_state:   # rank 0 writes, one tensor
            export_state(strategy, self.cfg.save_state, self.cfg.save_optimizer_state)   # at a time
        if self.trace_dir is not None:   # traces are flushed: a summary and scalars beside them
            record_run(self.trace_dir, self.rank, self.world_size, self.cfg.strategy, result)

    @staticmethod
    def merged(cfg, per_rank: list[dict]) -> dict:
        cfg, first = lab_config(cfg), per_rank[0]
        # A step takes as long as its slowest rank; the median over steps after the first (warm-up).
        slowest = [max(times) for times in zip(*(r["step_times"] for r in per_rank))]
        timed = slowest[1:] if len(slowest) > 1 else slowest
        out = {"step_time_s": statistics.median(timed) if timed else None,   # None: a resumed run
               "memory": [r["memory"] for r in per_rank], "trace_dir": first["trace_dir"]}
        if cfg.checkpoint_dir:   # the step the run started from (0: no checkpoint was there)
            out["resumed_from"] = first["resumed_from"]
        for key in ("state_dict", "optimizer_state"):     # rank 0's gathered copy, where asked
            if key in first:
                out[key] = first[key]
        if "moe" in first:   # per rank, per step (moe_step_record)
            out["moe"] = [r["moe"] for r in per_rank]
        return out


def sync(device) -> None:
    """Wait for the device's queued work (a step's time on a GPU is when its kernels end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_several_recording_memory(cfgs, record_memory: list[bool], timeout: float = 900.0):
    """train_several_on_ranks with `record_memory` set where asked; each such result gains
    `transient_peak` (rank -> bytes), as notebooks 04-05 read it."""
    cfgs = [lab_config(c).with_(record_memory=bool(m)) for c, m in zip(cfgs, record_memory, strict=True)]
    results = train_several_on_ranks(cfgs, timeout=timeout)
    for cfg, result in zip(cfgs, results):
        if cfg.record_memory:
            result["transient_peak"] = {r: m["transient_peak"]
                                        for r, m in enumerate(result["memory"])}
    return results


def train_several_on_ranks(cfgs: list[TrainConfig], timeout: float = 900.0,
                           quiet: bool = True) -> list[dict]:
    """Several configurations, one after another, in one launch of the same ranks."""
    for cfg in cfgs:
        train.validate(cfg)
    if len({cfg.nproc for cfg in cfgs}) != 1:
        raise ValueError("train_several_on_ranks needs the same nproc for every configuration")
    if len({process_group.launch_backend(cfg) for cfg in cfgs}) != 1:
        raise ValueError("train_several_on_ranks needs every configuration on the same device")
    runs = launch.run(_train_several, cfgs[0].nproc, cfgs, timeout=timeout, quiet=quiet,
                      backend=process_group.launch_backend(cfgs[0]))
    return [train.merge_results(cfg, [rank_runs[i] for rank_runs in runs])
            for i, cfg in enumerate(cfgs)]


def _train_several(rank: int, world_size: int, cfgs: list[TrainConfig]) -> list[dict]:
    results = [train.train_rank(rank, world_size, cfg) for cfg in cfgs]
    # Free the strategies' reference cycles (models, hooks, DDP reducers) now, while torch and the
    # process group are alive: left to the interpreter's exit they can abort the rank
    # ("terminate called without an active exception").
    gc.collect()
    return results
