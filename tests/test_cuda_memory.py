"""refimpl.lab.measure.cuda_memory: the allocator's rounding, computed; on a GPU, measured to the byte."""
import pytest
import torch

from refimpl.lab.measure import cuda_memory as cuda_memory
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


def test_activations_are_read_at_the_forward_backward_peak():
    """The default GPT's bytes (rounded figures): params P, a peak reached with a quarter of the
    gradients landed, AdamW's m and v (2P) made by opt.step() after it. The old figure, the peak
    less everything resident after the step, subtracted m and v that did not exist at the peak."""
    params, batch, acts = 5_644_288, 4_096, 15_000_000
    grads_at_peak, all_grads, m_and_v = params // 4, params, 2 * params
    peak = params + batch + acts + grads_at_peak
    assert cuda_memory.activations_at_peak(peak, params + batch, grads_at_peak) == acts
    kept_after_step = params + batch + all_grads + m_and_v
    assert peak - kept_after_step < 0          # the old formula: not even positive here


def test_the_gradients_at_the_peak_are_those_landed_before_it_rose():
    """CPU: a fake peak counter that rises only after the last layer's two gradients have landed
    (autograd lands a layer's weight and bias before it runs the layer below). The peak was reached
    with those two resident: 8000 B -> 8192 and 40 B -> 512 in 512-byte blocks."""
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    reads = []

    def read_peak():                 # 1st read at construction, then one per landing, one at close
        reads.append(None)
        return 100 if len(reads) <= 3 else 200

    landed = cuda_memory.GradsAtPeak(list(model.parameters()), read_peak)
    model(torch.randn(4, 300)).sum().backward()
    landed.close()
    assert landed.bytes == 8192 + 512 and len(reads) == 1 + 4 + 1
    model(torch.randn(4, 300)).sum().backward()
    assert len(reads) == 6                     # close() removed the hooks


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_the_activation_row_holds_at_least_the_logits():
    df = cuda_memory.measure_model_states(batch=8, seq=32).set_index("category")
    acts = df.loc[df.index.str.startswith("activations"), "measured_bytes"].item()
    assert acts >= 8 * 32 * GPTConfig().vocab_size * 4      # the fp32 logits alone are saved
