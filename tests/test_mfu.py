"""Model FLOPs utilisation (refimpl.lab.measure.mfu): the FLOPs per token against PyTorch's own count, the
1B model's published size, and a real measurement, eager and compiled, on the CPU."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from refimpl.lab.measure import mfu
from refimpl.model import GPTConfig, build_model, lm_loss
from refimpl.model.gpt import count_params

SHAPES = {
    "gpt": GPTConfig(),
    "gpt tied": GPTConfig(tie_embeddings=True),
    "llama gqa": GPTConfig(arch="llama", n_kv_heads=2),
    "llama tied, own ffn": GPTConfig(arch="llama", n_kv_heads=4, ffn_hidden=96, tie_embeddings=True),
}


@pytest.mark.parametrize("name", SHAPES)
def test_flops_per_token_is_what_pytorch_counts_in_a_forward_and_backward(name):
    """6 W + 12 L h s per token, for a batch whose sequences are shorter than the model's context:
    FlopCounterMode counts every matmul the forward and backward run (linear layers, Q·Kᵀ, the
    scores' mix of V, the output layer), and nothing else."""
    cfg = SHAPES[name]
    model = build_model(cfg, 0)
    batch, seq = 3, 48
    g = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(cfg.vocab_size, (batch, seq), generator=g) for _ in range(2))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(idx), targets).backward()
    assert counter.get_total_flops() == mfu.flops_per_token(cfg, seq) * batch * seq


def test_the_1b_model_has_llama_3_2_1b_s_parameters():
    """1,235,814,400: meta-llama/Llama-3.2-1B's count (its config.json's shapes, the model card's
    1.23B), of which all but the 16 x 2 + 1 RMSNorm gains multiply activations (the tied output
    layer counted once)."""
    cfg = mfu.LLAMA_3_2_1B
    model = build_model(cfg, 0, device="meta")
    assert count_params(model) == 1_235_814_400
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    assert mfu.matmul_weights(cfg) == count_params(model) - norms


def test_peak_flops_comes_from_the_datasheet_table_by_the_name_cuda_reports(monkeypatch):
    """The SXM parts at their 989 TFLOP/s; the NVL and PCIe cards of the same die at their own
    datasheet's (half the "with sparsity" figure: 1,671 and 1,513), not the SXM's; a GH200 is not
    an H200 and a part not tabled has no peak."""
    names = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA H100 NVL": 835.5e12, "NVIDIA H200 NVL": 835.5e12, "NVIDIA H100 PCIe": 756.5e12,
             "NVIDIA GH200 480GB": None, "Tesla T4": None}
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert mfu.peak_flops("cuda") == peak, name
    assert mfu.peak_flops("cpu") is None


def test_a_measured_step_trains_and_compiling_each_block_traces_one_graph_for_all():
    """Eager, then every block compiled (the "aot_eager" backend: dynamo's trace and AOTAutograd's
    forward/backward graphs, without inductor's code generation, which takes ~30 s on a CPU): the
    same losses, the loss falls, one graph serves all four blocks, no graph breaks, and no MFU on a
    CPU (no datasheet peak)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    cfg = GPTConfig(arch="llama", n_kv_heads=2)
    eager = mfu.measure(cfg, 2, 32, steps=3, warmup=1, device="cpu", precision="fp32")
    torch._dynamo.reset()
    counters.clear()
    compiled = mfu.measure(cfg, 2, 32, steps=3, warmup=1, device="cpu", precision="fp32",
                           compile=True, compile_backend="aot_eager")
    assert eager["loss_last"] < eager["loss_first"]
    assert compiled["loss_first"] == pytest.approx(eager["loss_first"], rel=1e-6)
    assert compiled["loss_last"] == pytest.approx(eager["loss_last"], rel=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    assert eager["mfu"] is None and eager["achieved_flops"] > 0
    assert eager["params"] == count_params(build_model(cfg, 0))


def test_torchtitans_mfu_from_its_published_tokens_per_second():
    """Llama 3.1 8B as torchtitan configures it has the released model's 8,030,261,248 parameters,
    and torchtitan's published tokens/s per GPU, times flops_per_token at 8192 tokens over H100
    SXM's peak, land in the "33% to 39% MFU" its text states (its own FLOPs code, its own logs)."""
    assert count_params(build_model(mfu.LLAMA_3_1_8B, 0, device="meta")) == 8_030_261_248
    rows = mfu.torchtitan_mfu()
    assert len(rows) == 4 and all(0.33 <= round(r["MFU"], 2) <= 0.39 for r in rows), rows
    assert {round(r["MFU"], 2) for r in rows} >= {0.33, 0.39}, rows      # both ends of its range

def test_the_benchmark_script_runs_on_a_cpu_and_says_mfu_is_not_defined_there():
    """scripts/bench_mfu.py on the CPU: the small Llama-shaped model, eager, one row whose MFU
    column reads n/a (no datasheet peak), beside torchtitan's published figure."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "scripts/bench_mfu.py", "--device", "cpu", "--steps", "2"],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("eager")]
    assert len(rows) == 1 and rows[0][5] == "n/a", done.stdout
    assert "torchtitan" in done.stdout
