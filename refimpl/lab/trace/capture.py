"""Capture: every rank profiles its own steps into one run folder, in TensorBoard's layout.

`profiles/<notebook>/<run>/rank<r>.<id>.pt.trace.json`, so `make tensorboard` lists the run and its
profiler plugin shows one worker per rank. A schedule marks each step (ProfilerStep#N).
"""
from __future__ import annotations

import os
from pathlib import Path

from refimpl.lab.config import lab_config
from refimpl.lab.trace.native_stderr import quiet_profiler_in_notebook

# torch is imported inside the capture functions only: the TensorBoard plugin reads traces without it.


def profiles_root() -> Path:
    """The TensorBoard logdir: $REFIMPL_PROFILES, else the repo's profiles/ folder, else ./profiles."""
    if os.environ.get("REFIMPL_PROFILES"):
        return Path(os.environ["REFIMPL_PROFILES"]).resolve()
    repo_profiles = Path(__file__).resolve().parents[3] / "profiles"   # refimpl/lab/trace/ -> repo
    if repo_profiles.is_dir():
        return repo_profiles
    return Path.cwd() / "profiles"


def run_dir(group: str, run: str) -> Path:
    """profiles/<group>/<run>, e.g. run_dir("00_memory", "single-step")."""
    return profiles_root() / group / run


def profiled(cfg, group: str, run: str):
    """`cfg` with profiling on, writing to profiles/<group>/<run> (a notebook's runs, by name)."""
    return lab_config(cfg).with_(profile=True, trace_dir=str(run_dir(group, run)))


def _all_threads_config(all_threads: bool):
    """Optionally record every thread, not only the one that started the profiler.

    refimpl.comm's asynchronous collectives run on a worker thread of their own, which the default
    profiler does not see (the backends' own threads, gloo's and NCCL's, are recorded either way).
    It is opt-in because in torch 2.13 recording all threads drops the allocator's memory events,
    which TensorBoard's memory view needs.
    """
    if not all_threads:
        return None
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:            # an older torch without the option: the calling thread only
        return None


class StepProfiler:
    """Profile a loop of steps on this rank; call `.step()` after each one.

    The first step is warm-up (allocations, lazy inits), the next `active` steps are recorded.
    With a single step, that step is recorded.
    """

    def __init__(self, out_dir: str | Path | None, rank: int, steps: int, active: int = 3,
                 all_threads: bool = False, device=None):
        self.enabled = out_dir is not None
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if not self.enabled:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        warmup = 1 if steps > 1 else 0
        active = max(1, min(active, steps - warmup))
        activities = [ProfilerActivity.CPU]
        # GPU kernels when this rank computes on a GPU (device None: whenever there is one). A CPU
        # rank on a GPU machine skips CUPTI: it would only start a CUDA context per rank.
        on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        if on_gpu:
            activities.append(ProfilerActivity.CUDA)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(self.out_dir), worker_name=f"rank{rank}"),
            record_shapes=False, profile_memory=True, with_stack=False,
            experimental_config=_all_threads_config(all_threads))

    def __enter__(self):
        if self.enabled:
            self._quiet = quiet_profiler_in_notebook()   # kineto's start/stop lines, in a kernel
            self._quiet.__enter__()
            self._prof.__enter__()
        return self

    def step(self) -> None:
        if self.enabled:
            self._prof.step()

    def __exit__(self, *exc):
        if self.enabled:
            try:
                self._prof.__exit__(*exc)
            finally:
                self._quiet.__exit__(*exc)
