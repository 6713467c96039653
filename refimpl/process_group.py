"""A rank joins its process group: the backend (NCCL with a GPU per rank, gloo otherwise), the
rank's device; and a rank under torchrun, which runs `fn` for itself alone."""
from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from refimpl.launch_tools import tools

# Set on every child refimpl.launch.run starts: a nested `run` inside a rank is not torchrun's.
CHILD_MARK = "REFIMPL_RANK_CHILD"


def pick_backend(world_size: int, backend: str = "auto") -> str:
    """NCCL only when every rank can have a GPU of its own; gloo (CPU) otherwise; or the launch
    tools' own backend where they have one (refimpl.launch_tools)."""
    if backend != "auto":
        return backend
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    return tools().backend(world_size) or ("nccl" if gpus else "gloo")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and CHILD_MARK not in os.environ


def run_this_torchrun_rank(fn, args, kwargs, backend: str, timeout: float):
    """Under torchrun every process calls `run`; each runs `fn` once, for its own rank, on the
    backend asked for and with the caller's `timeout` for its process group."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    created = not dist.is_initialized()
    if created:
        # Multi-node: each node needs a GPU per *local* rank, not per rank of the whole world.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        chosen = pick_backend(local, backend)
        tools().torchrun_picked(local, backend, chosen)
        init_process_group(rank, world_size, chosen, timeout=timeout)
    try:
        return fn(rank, world_size, *args, **kwargs)
    finally:
        if created:
            gc.collect()    # as refimpl._rank does, while the interpreter is whole (core_notes.md)
            dist.destroy_process_group()


def init_process_group(rank: int, world_size: int, backend: str, timeout: float = 600.0) -> None:
    """Join the default process group: our own child through the store the caller hosts (it counts
    as one extra client), a rank torchrun started through its environment (env://)."""
    launched = CHILD_MARK in os.environ
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    options = {"rank": rank, "world_size": world_size, "timeout": timedelta(seconds=timeout)}
    if launched:
        options["store"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                         world_size + 1, is_master=False, timeout=options["timeout"])
    tools().joining(backend, launched, options)    # e.g. the lab's group timeout, staged backend
    dist.init_process_group(backend, **options)


def device_for(backend: str):
    """The device this rank computes on: its own GPU under NCCL, the CPU under gloo, where the
    launch tools say under a backend of theirs."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tools().device(backend)


def launch_backend(cfg) -> str:
    """gloo for a run told device "cpu", even where GPUs would give NCCL; else pick_backend's."""
    return "gloo" if cfg.device == "cpu" else "auto"


def backend_and_device(cfg) -> tuple:
    """A rank computes where its backend puts it. The in-process run (no process group) computes
    on `cfg.device`: a reference sets it to its comparison's ranks' device (never straddling)."""
    if dist.is_initialized():
        backend = dist.get_backend()
        return backend, device_for(backend)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return ("nccl", torch.device("cuda", 0)) if use_cuda else ("gloo", torch.device("cpu"))
