"""refimpl.lab.measure.ceilings: the ceiling is the device's own, and sweep sizes scale with the device."""
import pytest
import torch

from refimpl.lab.measure import ceilings
from refimpl.launch import pick_backend

GPU = torch.cuda.is_available()


def test_ceiling_follows_the_backend_of_the_ranks():
    c = ceilings.ceiling_for(2, nbytes=8 << 20)
    assert c["backend"] == pick_backend(2)
    if c["backend"] == "gloo":
        assert c["kind"] == "memcpy, one CPU core"
    assert c["bytes_per_s"] > 1e8          # any machine copies faster than 100 MB/s


def test_sweep_sizes_are_per_device():
    assert ceilings.max_message_bytes("gloo") == 4 << 20
    top = ceilings.max_message_bytes("nccl")
    assert top & (top - 1) == 0 and top <= ceilings.DEFAULT_MAX_BYTES["nccl"]
    if not GPU:
        assert top == 1 << 30             # the knob's default; capped by free memory on a GPU


def test_cpu_copy_sweep_has_one_row_per_size():
    df = ceilings.copy_sweep("cpu", sizes=[1 << 12, 1 << 16, 1 << 20], repeats=3)
    assert df.size_bytes.tolist() == [1 << 12, 1 << 16, 1 << 20]
    assert (df.kind == "memcpy, one core").all() and (df.bytes_per_s > 0).all()


@pytest.mark.skipif(GPU, reason="checks the message a CPU-only machine gives")
def test_cuda_copy_says_it_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a GPU"):
        ceilings.cuda_copy_bandwidth(1 << 20)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_device_copy_beats_one_cpu_core():
    d2d = ceilings.cuda_copy_bandwidth(256 << 20)
    assert d2d > ceilings.memcpy_bandwidth(64 << 20)
    if torch.cuda.device_count() >= 2:
        assert ceilings.cuda_copy_bandwidth(256 << 20, 0, 1) < d2d   # a link is slower than HBM
