"""refimpl.lab.env: the machine as the workbook sees it, and the device a comparison's reference uses."""
import json
import subprocess
import sys

import pytest
import torch

from refimpl import launch
from refimpl.config import TrainConfig
from refimpl.lab.env import GPU, SHARED_DEVICE, GiB, Machine, machine
from refimpl.lab.verify.equivalence import ranks_device
from refimpl.mesh import LayoutError
from refimpl.process_group import backend_and_device as _backend_and_device
from refimpl.train import validate

H200 = GPU("NVIDIA H200", 143771 * 2 ** 20)


def test_this_machine_agrees_with_the_launcher():
    m = machine()
    assert m.cpu_cores >= 1 and m.torch_version == torch.__version__
    assert m.gpu_count == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for n in (1, 2, 3, 4):
        assert m.backend_for(n) == launch.pick_backend(n)
        assert m.device_for(n) == ranks_device(n)


def test_summary_is_computed_from_the_facts(monkeypatch):
    monkeypatch.delenv("REFIMPL_SHARED_DEVICE", raising=False)
    cpu = Machine(cpu_cores=2, memory_bytes=24 * 2 ** 30)
    assert cpu.summary(2) == "this machine: 2 CPU cores, 24.0 GiB, no GPU; 2 ranks run on gloo (CPU)"
    one_gpu = Machine(cpu_cores=16, memory_bytes=None, gpus=(H200,))
    line = one_gpu.summary(2)
    assert "16 CPU cores, 1 x NVIDIA H200 (140.4 GiB each)" in line and "gloo (CPU)" in line
    assert "NCCL needs one GPU per rank" in line and "reference runs on CPU" in line
    eight = Machine(cpu_cores=96, memory_bytes=None, gpus=(H200,) * 8)
    assert eight.backend_for(8) == "nccl" and eight.backend_for(9) == "gloo"
    assert eight.summary(4).endswith("4 ranks run on nccl (one GPU per rank)")
    assert one_gpu.where(1) == "one GPU (CUDA)" and one_gpu.device_for(1) == "cuda"
    with pytest.raises(ValueError):
        cpu.backend_for(0)
    monkeypatch.setenv("REFIMPL_SHARED_DEVICE", "cuda:0")     # several ranks on one GPU
    assert eight.backend_for(4) == "staged" and eight.device_for(4) == "cuda"
    assert one_gpu.summary(2).endswith("2 ranks run on cuda:0, shared under NCCL's rules "
                                       "(the staged backend)")


@pytest.mark.slow   # two CLI processes, each importing torch
def test_cli_env_prints_json_and_text():
    out = subprocess.run([sys.executable, "-m", "refimpl", "env", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    d = json.loads(out)
    assert d["cpu_cores"] == machine(topology=False).cpu_cores
    assert d["backend_for"]["2"] == launch.pick_backend(2)
    text = subprocess.run([sys.executable, "-m", "refimpl", "env"], capture_output=True,
                          text=True, timeout=120, check=True).stdout
    assert text.startswith("this machine: ")


def test_reference_device_follows_the_comparisons_ranks():
    # The in-process reference computes where `cfg.device` says; a comparison sets the ranks'.
    ref = TrainConfig(device=ranks_device(2))
    backend, device = _backend_and_device(ref)
    assert device.type == ranks_device(2)
    assert _backend_and_device(TrainConfig(device="cpu"))[1].type == "cpu"
    with pytest.raises(LayoutError):
        validate(TrainConfig(device="tpu"))
    if not torch.cuda.is_available():
        with pytest.raises(LayoutError, match="no GPU"):
            validate(TrainConfig(device="cuda"))


def test_the_reference_runs_where_the_ranks_run(monkeypatch):
    """Ranks sharing one GPU (the staged backend) compute on it, so their reference does too; a
    run kept on the CPU (device "cpu") has a CPU reference even where GPUs are enough for NCCL."""
    from refimpl.lab.verify.equivalence import reference_config

    monkeypatch.setenv("REFIMPL_SHARED_DEVICE", "cuda:0")
    assert ranks_device(2) == "cuda"
    assert reference_config(TrainConfig(strategy="dp", nproc=2)).device == "cuda"
    monkeypatch.setenv("REFIMPL_SHARED_DEVICE", "cpu")
    assert ranks_device(2) == "cpu"
    monkeypatch.delenv("REFIMPL_SHARED_DEVICE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)    # a node with 8 GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert ranks_device(2) == "cuda" and ranks_device(2, "cpu") == "cpu"
    assert reference_config(TrainConfig(strategy="dp", nproc=2, device="cpu")).device == "cpu"


def test_runs_note_names_each_backend_and_flags_a_mix(monkeypatch):
    monkeypatch.delenv(SHARED_DEVICE, raising=False)
    cpu = Machine(2, 24 * GiB)
    assert cpu.runs_note((2, 4, 2), 1.5) == (
        "this notebook launches 2 and 4 ranks (on gloo (CPU)); about 1.5 min on a 2-core CPU "
        "machine. This machine: 2 CPU cores, 24.0 GiB, no GPU.")
    two = Machine(16, None, (GPU("H100", 80 * GiB),) * 2)
    note = two.runs_note((1, 2, 3), 2)
    assert "1 rank on one GPU (CUDA); 2 ranks on nccl (one GPU per rank); 3 ranks on gloo (CPU)" in note
    assert "Mixed backends" in note and "has 2;" in note
    assert "Mixed" not in Machine(16, None, (GPU("H100", 80 * GiB),) * 8).runs_note((1, 2, 8), 2)
    assert cpu.runs_note((), 0.5).startswith("this notebook launches no ranks: everything runs in")
