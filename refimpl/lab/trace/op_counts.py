"""Operator-level views of a step (seed §2.4): torch.profiler's own table, op counts, and nsys.

* `profile_step` runs one forward + backward (+ optimizer step) of a model under torch.profiler in
  this process and returns the profiler, so `prof.key_averages().table(...)` shows the operators a
  real step spends its time in, as the PyTorch profiler recipe does; on a GPU with CUDA activity,
  sorted by device time as the seed's table is (`time_column`).
* `op_calls` / `calls_per_step` count how often an operator ran; activation checkpointing shows up
  as every nn.Linear of a block running twice (`aten::linear`), one recomputed forward.
* `nsys_command` is what to run on a GPU server: Nsight Systems records CUDA kernels, NCCL kernels
  and NVTX ranges of every rank on one timeline, which torch.profiler's CPU trace cannot show.
"""
from __future__ import annotations

import torch
from torch import nn

from refimpl.lab.instrument.labels import phase
from refimpl.lab.trace.native_stderr import quiet_profiler_in_notebook
from refimpl.model import lm_loss


def profile_step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                 optimizer: torch.optim.Optimizer | None = None):
    """One training step of `model` under torch.profiler (shapes recorded): CPU activity, and CUDA
    activity (each kernel's time on the device) when the model lives on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if next(model.parameters()).is_cuda:
        activities.append(ProfilerActivity.CUDA)
    with quiet_profiler_in_notebook(), profile(activities=activities, record_shapes=True) as prof:
        with phase("forward"):
            loss = lm_loss(model(inputs), targets)
        with phase("backward"):
            loss.backward()
        if optimizer is not None:
            with phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    return prof


def time_column(prof) -> str:
    """The column to sort `key_averages().table` by: the seed's "cuda_time_total" (torch 2.x reads
    it as device_time_total, the kernels' time) where the profile recorded device time, else
    "cpu_time_total" (a CPU run has no device column to sort by)."""
    on_device = any(e.device_time_total > 0 for e in prof.key_averages())
    return "cuda_time_total" if on_device else "cpu_time_total"


def op_calls(prof, name: str) -> int:
    """How many times operator `name` ran under `prof`."""
    return sum(e.count for e in prof.key_averages() if e.key == name)


def linear_layers(module: nn.Module) -> int:
    """nn.Linear modules inside `module` (each is one aten::linear per forward)."""
    return sum(isinstance(m, nn.Linear) for m in module.modules())


def calls_per_step(df, name: str, rank: int = 0) -> float:
    """Calls of op `name` per profiled step of `rank`, from `load_trace(..., include_ops=True)`."""
    ran = df[(df.name == name) & (df["rank"] == rank) & df.step.notna()]
    steps = df[(df.category == "step") & (df["rank"] == rank)]
    return len(ran) / len(steps)


def nsys_command(strategy: str = "dp", nproc: int = 8, steps: int = 10,
                 output: str = "profiles/nsys/rank%q{RANK}") -> str:
    """The Nsight Systems command line for a GPU server: one report per rank.

    torchrun starts `nsys profile` as each rank (`--no-python`), and nsys runs the training under
    it; `%q{RANK}` puts the RANK torchrun set into each report's name. `--trace=cuda,nvtx,osrt`
    records kernels (NCCL's included), NVTX ranges and OS runtime calls; torch.profiler's
    record_function labels become NVTX ranges under `torch.autograd.profiler.emit_nvtx()`.
    Open the .nsys-rep files in the Nsight Systems GUI.
    """
    return (f"torchrun --nproc-per-node {nproc} --no-python nsys profile --trace=cuda,nvtx,osrt "
            f"--output={output} python -m refimpl train --strategy {strategy} --nproc {nproc} "
            f"--steps {steps}")
