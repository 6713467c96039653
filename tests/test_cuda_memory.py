"""refimpl.memory.cuda: the allocator's rounding, computed; on a GPU, measured to the byte."""
import pytest
import torch

from refimpl.memory import cuda as cuda_memory
from refimpl.memory import model_state_bytes
from refimpl.model import GPTConfig, build_model, count_params

GPU = torch.cuda.is_available()


def test_allocator_rounds_every_request_up_to_512_bytes():
    assert [cuda_memory.allocator_bytes(n) for n in (0, 1, 4, 512, 513, 1000)] == [
        0, 512, 512, 512, 1024, 1024]


def test_views_count_once_and_small_tensors_pay_the_rounding():
    w = torch.zeros(1000)                       # 4000 B -> 4096
    bias = torch.zeros(1)                       # 4 B -> 512
    assert cuda_memory.tensors_allocator_bytes([w, w[:10], bias, None]) == 4096 + 512
    model = build_model(GPTConfig(), 0)
    params = list(model.parameters())
    counted = sum(p.numel() * 4 for p in params)
    assert counted == 4 * count_params(model)
    assert cuda_memory.tensors_allocator_bytes(params) >= counted   # every tensor rounds up


@pytest.mark.skipif(GPU, reason="checks the message a CPU-only machine gives")
def test_measuring_says_it_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a GPU"):
        cuda_memory.measure_model_states()


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_memory_allocated_equals_the_rounded_arithmetic():
    df = cuda_memory.measure_model_states().set_index("category")
    n = count_params(build_model(GPTConfig(), 0))
    want = model_state_bytes(n, param_bytes=4, grad_bytes=4, optimizer_bytes=8, padded=False)
    assert df.loc["params", "counted_bytes"] == want.params
    assert df.loc["grads", "counted_bytes"] == want.grads
    assert df.loc["optimizer (m, v)", "counted_bytes"] == want.optimizer
    model_rows = df.loc[["params", "grads", "optimizer (m, v)"]]
    assert (model_rows.allocator_bytes == model_rows.measured_bytes).all(), model_rows
