"""Deterministic kernels only where an equivalence check needs them (refimpl.lab.runtime.numerics; issue 35).

The decision runs anywhere; the switch itself is torch's process-wide flag, which a CPU build
sets and reads as a GPU build does, so it is checked here both ways (and put back).
"""
import pytest
import torch

from refimpl.config import TrainConfig
from refimpl.lab.config import LabConfig
from refimpl.lab.env import numerics_settings
from refimpl.lab.runtime import numerics
from refimpl.lab.verify.equivalence import reference_config

CUDA, CPU = torch.device("cuda", 1), torch.device("cpu")


def _needed(cfg: TrainConfig, device=CUDA) -> bool:
    return numerics.deterministic_needed(device, cfg.dtype, cfg.mixed_precision, cfg.return_state)


def test_only_compared_runs_on_cuda_get_deterministic_kernels():
    compared = LabConfig(strategy="dp", nproc=2, return_state=True)
    assert _needed(compared) and _needed(reference_config(compared))     # both sides of a check
    assert _needed(LabConfig(dtype="float64"))                          # the equivalence proof
    assert not _needed(LabConfig(strategy="dp", nproc=2))               # training, bench, profile
    assert not _needed(LabConfig(profile=True))
    bf16 = LabConfig(mixed_precision="bf16", return_state=True)         # compared at 2e-2, never exact
    assert not _needed(bf16) and not _needed(reference_config(bf16))
    assert not _needed(compared, CPU) and not _needed(LabConfig(dtype="float64"), "cpu")


@pytest.fixture
def restored():
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              getattr(torch.backends.cuda.matmul, "fp32_precision", None),
              getattr(torch.backends.cudnn, "fp32_precision", None))
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
    if before[4] is not None:
        torch.backends.cuda.matmul.fp32_precision = before[4]
        torch.backends.cudnn.fp32_precision = before[5]


def test_the_switch_turns_deterministic_mode_on_and_off_again(restored):
    assert not numerics.exact_fp32_on_cuda(CPU, deterministic=True)      # CPU: nothing is set
    assert not torch.are_deterministic_algorithms_enabled()
    assert numerics.exact_fp32_on_cuda(CUDA, deterministic=True)
    assert numerics_settings()["deterministic"] and torch.backends.cudnn.deterministic
    # a timed run after a compared one in the same process: off again
    assert numerics.exact_fp32_on_cuda(CUDA, deterministic=False)
    assert not numerics_settings()["deterministic"] and not torch.backends.cudnn.deterministic
    assert numerics_settings()["matmul_fp32"] in ("ieee", "highest")     # fp32 stays fp32 either way
