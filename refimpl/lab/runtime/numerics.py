"""fp32 that means fp32 on a GPU: the settings every CUDA run of the loop uses, applied through
refimpl.launch_tools' `device_settings` once a rank's device is known (refimpl.train.setup_rank)."""
from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def deterministic_needed(device, dtype: str, mixed_precision: str, return_state: bool) -> bool:
    """Does a run need deterministic kernels? Only on CUDA, and only when its result is compared:
    float64 runs (the equivalence proof) and fp32 runs that hand back their state to be compared
    with `single` (refimpl.lab.verify.equivalence sets return_state on both sides; some layouts are
    claimed bit for bit). bf16 is compared at 2e-2 and never called exact; a run that returns no
    state (training, a benchmark, a profile) is timed, not compared."""
    if torch.device(device).type != "cuda" or mixed_precision == "bf16":
        return False
    return dtype == "float64" or return_state


def exact_fp32_on_cuda(device: torch.device, deterministic: bool = False) -> bool:
    """Apply the settings above when `device` is a GPU, deterministic kernels only if asked
    (`deterministic_needed`); return whether it did. Both ways: the settings are process-wide,
    and one process may run a compared configuration and then a timed one."""
    if torch.device(device).type != "cuda":
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        # torch >= 2.9 has a new switch and refuses to mix it with the old flags: use it alone.
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
    else:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = deterministic
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    return True
