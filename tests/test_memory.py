"""Memory arithmetic: the published figures, reproduced; and measured bytes equal counted bytes."""
import math

import pytest
import torch

from refimpl.config import TrainConfig
from refimpl.lab.instrument.activations import ActivationTracker
from refimpl.memory import (
    GB,
    activation_bytes_per_layer,
    model_state_bytes,
    training_flops,
)
from refimpl.train import train_on_ranks


def test_seed_70b_example():
    # The seed (section 1.1): bf16 weights 140 GB, grads 140 GB, Adam m+v in fp32 560 GB: 840 GB.
    s = model_state_bytes(70e9, param_bytes=2, grad_bytes=2, optimizer_bytes=8)
    assert (s.params / GB, s.grads / GB, s.optimizer / GB, s.total / GB) == (140, 140, 560, 840)


def test_zero_paper_table_7_5b_on_64_gpus():
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, Nd = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB.
    per_stage = [model_state_bytes(7.5e9, dp=64, zero_stage=z).total / GB for z in range(4)]
    assert [round(x, 1) for x in per_stage] == [120.0, 31.4, 16.6, 1.9]


def test_padding_makes_every_shard_equal():
    s = model_state_bytes(10, dp=3, zero_stage=3, param_bytes=1, grad_bytes=1, optimizer_bytes=1)
    assert s.params == math.ceil(10 / 3) == 4
    s1 = model_state_bytes(10, dp=3, zero_stage=1, param_bytes=1, grad_bytes=1, optimizer_bytes=1)
    assert (s1.params, s1.optimizer) == (12, 4)      # the flat buffer holds dp * ceil(N/dp)
    exact = model_state_bytes(10, dp=3, zero_stage=3, param_bytes=1, grad_bytes=1,
                              optimizer_bytes=1, padded=False)
    assert exact.params == pytest.approx(10 / 3)
    with pytest.raises(ValueError):
        model_state_bytes(10, zero_stage=4)


def test_korthikanti_activation_formulas():
    s, b, h, a = 2048, 4, 4096, 32
    base = activation_bytes_per_layer(s, b, h, a)
    assert base == s * b * h * (34 + 5 * a * s / h)
    # tensor parallel alone leaves 10 sbh replicated; sequence parallel splits everything by t
    assert activation_bytes_per_layer(s, b, h, a, tp=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True) == pytest.approx(base / 8)
    assert activation_bytes_per_layer(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    # the attention term grows as s^2: doubling s more than doubles the bytes
    assert activation_bytes_per_layer(2 * s, b, h, a) > 2 * base


def test_training_flops_is_6nd_plus_attention():
    assert training_flops(1e9, 1e12) == 6e21
    assert training_flops(1e9, 1e3, n_layers=2, seq=10, hidden=4) == 6e12 + 12 * 2 * 10 * 4 * 1e3


def test_measured_model_state_of_a_single_run_equals_the_arithmetic():
    # fp32 AdamW: 4-byte params, 4-byte grads, m and v (8 bytes) per parameter
    result = train_on_ranks(TrainConfig(steps=1))
    n = result["n_params"]
    expected = model_state_bytes(n, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    mem = result["memory"][0]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (
        expected.params, expected.grads, expected.optimizer)


def test_activation_tracker_counts_saved_tensors_once_and_excludes_parameters():
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    with ActivationTracker() as act:
        y = torch.tanh(x @ w)           # matmul saves x (and w: a parameter, not counted)
        z = (y * y).sum()               # tanh saves its output y; y*y saves y again (same storage)
    assert act.peak == x.numel() * 4 + y.numel() * 4
    z.backward()
    del y, z
    assert act.current == 0             # backward freed the graph, the tracker saw it


def test_activation_checkpointing_saves_measured_memory():
    full = train_on_ranks(TrainConfig(steps=1))["memory"][0]["activations_peak"]
    ckpt = train_on_ranks(TrainConfig(steps=1, activation_checkpointing=True))["memory"][0]["activations_peak"]
    assert ckpt < full / 2


@pytest.mark.parametrize("kv_heads, dtype", [(2, torch.float32), (6, torch.float64)])
def test_llama_block_activations_are_what_the_tracker_counts(kv_heads, dtype):
    # refimpl.lab.plan.memory.llama_block_activation_bytes against the bytes autograd saves for one
    # --arch llama block (dims chosen apart: s·b != h, w, so no two terms can stand in for each other)
    from refimpl.lab.plan.memory import llama_block_activation_bytes
    from refimpl.model import Block, GPTConfig

    cfg = GPTConfig(arch="llama", d_model=48, n_heads=6, n_kv_heads=kv_heads, ffn_hidden=80,
                    seq_len=20)
    block = Block(cfg).to(dtype)
    x = torch.randn(3, 20, 48, dtype=dtype, requires_grad=True)
    with ActivationTracker(exclude=block.parameters()) as tracker:
        block(x)
    predicted = llama_block_activation_bytes(20, 3, 48, 6, 80, dtype_bytes=dtype.itemsize)
    assert tracker.peak == predicted
