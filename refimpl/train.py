"""The one training loop every strategy plugs into.

    result = train_on_ranks(TrainConfig(strategy="single", steps=5))      # from a notebook
    python -m refimpl train --strategy single --steps 5 --json            # from a shell"""
from __future__ import annotations

import torch
import torch.distributed as dist

import refimpl.comm as refimpl_comm
from refimpl import launch
from refimpl.compose.transforms import model_parallel
from refimpl.config import RunContext, TrainConfig
from refimpl.launch_tools import tools
from refimpl.loop_extras import extras_class
from refimpl.mesh import Mesh
from refimpl.model import build_model, converted, count_params, synthetic_batch
from refimpl.process_group import backend_and_device, launch_backend
from refimpl.registry import Resolved, resolve
from refimpl.seam import use_collectives
from refimpl.strategy import Strategy


def validate(cfg: TrainConfig) -> Resolved:
    """Every layout check, in the launching process: raises LayoutError with one line, or returns
    the layout resolved (refimpl.registry: the shorthand's axes filled, the strategy's class)."""
    layout = resolve(cfg)
    extras_class().validate(layout.cfg, layout.strategy)   # the shared rules (refimpl.loop_extras)
    layout.strategy.validate(layout.cfg)
    return layout


def setup_rank(rank: int, world_size: int, layout: Resolved,
               place=None) -> tuple[RunContext, Strategy, int]:
    """This rank's context, its strategy placed, and the reference's parameter count: everything
    before the first step. `place(strategy)` builds, places and counts: `place_seeded`, or the
    loop extras' (the lab's builds only this rank's shard, or places a checkpoint's values)."""
    cfg = layout.cfg
    backend, device = backend_and_device(cfg)
    tools().device_settings(device, cfg)    # e.g. the lab's exact fp32 on a GPU
    mesh = Mesh(cfg.dims, rank)     # this rank's point of the grid, one process group per axis
    ctx = RunContext(rank, world_size, backend, device, cfg, mesh)
    use_collectives(refimpl_comm if cfg.collectives == "refimpl" else None)   # refimpl.seam
    torch.manual_seed(cfg.seed)
    strategy = layout.strategy(ctx)
    return ctx, strategy, (place or place_seeded)(strategy)


def place_seeded(strategy: Strategy) -> int:
    """The reference model built from the seed on the host, cut by the model-parallel transforms in
    their fixed order (refimpl.compose.transforms), moved to the device and handed to the
    strategy's data-parallel placement; returns the reference's parameter count."""
    ctx = strategy.ctx
    reference = converted(build_model(ctx.cfg.model, ctx.cfg.seed), dtype=ctx.param_dtype)
    n_params = count_params(reference)      # before the transforms cut it in place
    rank_model = strategy.transform(reference, model_parallel)
    converted(rank_model.module, device=ctx.device)
    strategy.place(rank_model)
    return n_params


def train_rank(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    """Train on this rank; run by `launch.run` on every rank (or once, for `single`). What the
    loop's extras measure (a step's time, the memory held) they add to the result."""
    layout = resolve(cfg)         # the axes a shorthand names, and the strategy's class
    cfg = layout.cfg
    extras = extras_class()(cfg, rank, world_size)     # the lab's (refimpl.loop_extras)
    ctx, strategy, n_params = setup_rank(rank, world_size, layout, extras.place)
    losses = list(extras.losses)
    with extras.steps(ctx, strategy, extras.first) as on_step:
        for step in range(extras.first, cfg.steps):
            batch = synthetic_batch(cfg.model, cfg.global_batch, cfg.seq_len, cfg.seed, step)
            with extras.measure_step(strategy):
                loss = strategy.train_step(batch)
            losses.append(float(loss))
            on_step(step, losses)
    result = {"rank": rank, "losses": losses, "n_params": n_params}
    extras.finish(strategy, result)
    return result


def train_on_ranks(cfg: TrainConfig, timeout: float = 900.0, quiet: bool = True) -> dict:
    """Validate, launch `cfg.nproc` ranks (or run in this process for nproc == 1), and merge."""
    validate(cfg)
    if launch.under_torchrun():
        # torchrun started one process per rank; each trains, then all exchange their results
        # so that every process can print the same merged JSON.
        (per_rank,) = launch.run(_train_rank_and_share, cfg.nproc, cfg, timeout=timeout,
                                 backend=launch_backend(cfg))
    elif cfg.nproc == 1 and cfg.strategy == "single":
        per_rank = [in_this_process(train_rank, 0, 1, cfg)]   # the reference needs no group
    else:
        per_rank = launch.run(train_rank, cfg.nproc, cfg, timeout=timeout, quiet=quiet,
                              backend=launch_backend(cfg))
    return merge_results(cfg, per_rank)


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
    mine = train_rank(rank, world_size, cfg)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def merge_results(cfg: TrainConfig, per_rank: list[dict]) -> dict:
    """One result for the run: rank 0's losses (each rank's is the global loss), what the loop's
    extras merge from every rank's (refimpl.loop_extras), and every rank's own."""
    first = per_rank[0]
    return {"strategy": cfg.strategy, "world_size": cfg.nproc, "losses": first["losses"],
            "n_params": first["n_params"], **extras_class().merged(cfg, per_rank),
            "per_rank": per_rank}
