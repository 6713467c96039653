"""What the lab adds as a rank joins its process group (refimpl.process_group.init_process_group,
through refimpl.launch_tools' `joining`): the group's timeout on NCCL (shorter than the launch's,
so NCCL's own watchdog dumps its flight recorder first), the rank's GPU handed to torch, one store
prefix per torchrun restart, and the line a torchrun prints when its ranks fall back to gloo."""
from __future__ import annotations

import os
from datetime import timedelta

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


def agent_store(world_size: int, timeout: float):
    """torchrun's store when its agent hosts it, under a prefix of this attempt's own, or None.

    The c10d rendezvous keeps ONE store for every restart of the job, and env:// puts the ranks'
    keys (gloo's listening addresses, NCCL's unique id) under the same names each attempt. A
    restarted rank could then read a dead peer's address and wait on it until the timeout (seen: 2
    restarts in 5 hung). The attempt's number in front of every key keeps each attempt to its own.
    Without an agent store (env:// with rank 0 hosting a fresh store each attempt): None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(f"refimpl/attempt{attempt}", store)


def add_options(options: dict, backend: str, launched: bool) -> None:
    """Complete `options` (init_process_group's keywords: rank, world_size, timeout, and the
    launcher's store for its own child) for this rank: run()'s children time out below the
    launcher on NCCL, torchrun's as asked; torchrun's agent store per attempt; NCCL's GPU."""
    timeout = options["timeout"].total_seconds()
    if launched:
        options["timeout"] = timedelta(seconds=group_timeout(timeout, backend))
    elif "store" not in options:
        store = agent_store(options["world_size"], timeout)
        if store is not None:
            options["store"] = store
    local_rank = int(os.environ.get("LOCAL_RANK", options["rank"]))
    options.update(process_group_kwargs(backend, local_rank))


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
