"""A rank joins its process group: the backend (NCCL with a GPU per rank, gloo otherwise), the
group's timeout, the rank's device; and a rank under torchrun, which runs `fn` for itself alone."""
from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta

from refimpl.host_heap import heap_policy
from refimpl.launch_tools import tools

# Set on every child refimpl.launch.run starts, so a nested `run` inside a rank is not mistaken
# for torchrun.
CHILD_MARK = "REFIMPL_RANK_CHILD"


def pick_backend(world_size: int, backend: str = "auto") -> str:
    """NCCL only when every rank can have a GPU of its own; gloo (CPU) otherwise."""
    if backend != "auto":
        return backend
    if os.environ.get("REFIMPL_SHARED_DEVICE"):     # several ranks on one device (shared_device)
        return "staged"
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and CHILD_MARK not in os.environ


def run_this_torchrun_rank(fn, args, kwargs, backend: str, timeout: float):
    """Under torchrun every process calls `run`; each runs `fn` once, for its own rank, on the
    backend asked for (gloo for a run kept on the CPU) and with the caller's `timeout` for its
    process group: torchrun has no watchdog of ours, so the group's is the one that ends a hang."""
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    created = not dist.is_initialized()
    if created:
        heap_policy()           # as our own ranks' (refimpl.host_heap): big blocks go back when freed
        # Multi-node: each node needs a GPU per *local* rank, not per rank of the whole world.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        chosen = pick_backend(local, backend)
        if backend == "auto" and chosen == "gloo" and os.environ.get("LOCAL_RANK", "0") == "0":
            import torch

            why = gloo_fallback_warning(local, torch.cuda.device_count() if torch.cuda.is_available()
                                        else 0, os.environ)
            if why:
                print(why, file=sys.stderr, flush=True)
        init_process_group(rank, world_size, chosen, timeout=timeout)
    try:
        return fn(rank, world_size, *args, **kwargs)
    finally:
        if created:
            # As refimpl._rank does: free the strategies' reference cycles (hooks, pending work,
            # the process groups they hold) now, while the interpreter is whole. Left to its
            # finalization, a gloo thread releasing the last reference to a tensor needs the GIL
            # there, and a thread refused the GIL at exit ends the process with SIGABRT.
            gc.collect()
            dist.destroy_process_group()


def gloo_fallback_warning(local_ranks: int, gpus: int, env) -> str | None:
    """One line for a torchrun whose ranks see GPUs, but fewer than one each: NCCL needs a GPU per
    rank, so they run on gloo (CPU). Under Slurm the usual cause is a task bound to one GPU
    (--gpus-per-task 1, or a CUDA_VISIBLE_DEVICES per task) while torchrun starts a rank per GPU
    of the node. None where there is no GPU (gloo is the plan) or one per rank."""
    if gpus == 0 or gpus >= local_ranks:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    slurm = (f"; Slurm job {env['SLURM_JOB_ID']}: give each torchrun all its node's GPUs "
             "(--gpus-per-node), not one per task") if env.get("SLURM_JOB_ID") else ""
    return (f"refimpl: warning: {local_ranks} ranks on this node but this process sees {gpus} "
            f"GPU{'s' if gpus != 1 else ''}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
            + f": NCCL needs one GPU per rank, so the ranks run on gloo (CPU){slurm} "
            "(--device cpu where gloo is meant)")


def process_group_kwargs(backend: str, local_rank: int, torch_version: str | None = None) -> dict:
    """init_process_group's extra arguments for this rank: `device_id` (the rank's GPU) for NCCL
    ranks where torch takes it (>= 2.3), nothing on CPU (gloo) and the other backends."""
    import torch

    if backend != "nccl":
        return {}
    version = torch.torch_version.TorchVersion(torch_version or torch.__version__)
    if version < (2, 3):
        return {}
    return {"device_id": torch.device("cuda", local_rank)}


# How much sooner than the launcher an NCCL group times out: a quarter of the launch's time, at
# most this many seconds (`group_timeout`).
NCCL_TIMEOUT_MARGIN_S = 60.0


def group_timeout(timeout: float, backend: str) -> float:
    """The process group's timeout in a launch that gives up after `timeout` seconds. On NCCL
    shorter, by a quarter of it and at most NCCL_TIMEOUT_MARGIN_S: a hung NCCL collective returned
    when it was posted, so the launcher's stall watchdog may never see it, but NCCL's own
    watchdog times it out, dumps its flight recorder and ends the rank while the launcher still
    waits; with equal timeouts the launcher killed the ranks first. gloo's ranks block inside the
    call, where the launcher's report finds them: its group keeps the launcher's timeout."""
    if backend != "nccl":
        return timeout
    return timeout - min(NCCL_TIMEOUT_MARGIN_S, timeout / 4)


def init_process_group(rank: int, world_size: int, backend: str, timeout: float = 600.0) -> None:
    """Join the default process group via MASTER_ADDR/MASTER_PORT; bind a GPU under NCCL."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    # run()'s children: below the launcher's timeout on NCCL; torchrun's: the one asked for
    group_wait = timedelta(seconds=group_timeout(timeout, backend) if CHILD_MARK in os.environ
                            else timeout)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    tools().joining(backend, launched=CHILD_MARK in os.environ)   # e.g. the staged backend
    extra = process_group_kwargs(backend, local_rank)
    if CHILD_MARK in os.environ:
        # Our own child: join the store the caller hosts (it counts as one extra client).
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              world_size + 1, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=group_wait, **extra)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun, whose agent hosts the store: the c10d rendezvous keeps ONE store for every
        # restart of the job, and env:// puts the ranks' keys (gloo's listening addresses, NCCL's
        # unique id) under the same names each attempt. A restarted rank could then read a dead
        # peer's address and wait on it until the timeout (seen: 2 restarts in 5 hung). The
        # attempt's number in front of every key keeps each attempt to its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              world_size, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=dist.PrefixStore(f"refimpl/attempt{attempt}", store),
                                rank=rank, world_size=world_size, timeout=group_wait, **extra)
    else:  # torchrun without an agent store: env:// (rank 0 hosts a fresh store each attempt)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=group_wait,
                                **extra)


def device_for(backend: str):
    """The device this rank computes on: its own GPU under NCCL, the CPU under gloo, the shared
    device under the staged backend, `meta` under the dry run's fake one."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "staged":     # every rank on the one shared device (refimpl.lab.runtime.shared_device)
        return torch.device(os.environ.get("REFIMPL_SHARED_DEVICE", "cpu"))
    if backend == "fake":       # the dry run (refimpl.lab.verify.dryrun): shapes only, no storage
        return torch.device("meta")
    return torch.device("cpu")


def launch_backend(cfg) -> str:
    """device "cpu" keeps the ranks on gloo even where there are GPUs enough for NCCL (the CPU
    planner check, refimpl.lab.plan.cpu); otherwise NCCL exactly when every rank gets a GPU."""
    return "gloo" if cfg.device == "cpu" else "auto"


def ranks_backend(cfg) -> str:
    """The backend cfg's ranks will run on, known before any of them starts: the one launch.run
    picks (under torchrun, for this node's ranks)."""
    ranks = cfg.nproc
    if under_torchrun():
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return pick_backend(ranks, launch_backend(cfg))


def backend_and_device(cfg) -> tuple:
    """A rank computes where its backend puts it. The in-process run (no process group) computes
    on `cfg.device`: a reference sets it to its comparison's ranks' device (never straddling)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        backend = dist.get_backend()
        return backend, device_for(backend)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return ("nccl", torch.device("cuda", 0)) if use_cuda else ("gloo", torch.device("cpu"))



def sync(device) -> None:
    """Wait for the device's queued work (a step's time on a GPU is when its kernels end)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
