"""Model FLOPs utilisation (MFU): the FLOPs a training step needs, per second, over the device's peak.

MFU (Chowdhery et al. 2022, PaLM, §4.1 and Appendix B) counts the FLOPs the model *needs*, not the
ones the step executes: recomputation (activation checkpointing, flash attention's backward) is
left out, so runs that recompute and runs that do not are on one scale. Per token, a dense decoder
needs

    6 · W  +  12 · L · h · s

  W          every weight that multiplies an activation: the blocks' linear layers and the output
             layer. 2 FLOPs per weight forward (a multiply and an add), 4 backward (the input's
             gradient and the weight's): Kaplan et al. 2020, §2.1.
  12·L·h·s   attention's two matmuls, Q·Kᵀ and the scores' mix of V: 2·s·h FLOPs each per token
             and layer forward, twice that backward, L layers. Counted over the whole s x s
             square, as PaLM and torchtitan count it, although a causal mask needs only half.

The token embedding is a lookup and costs no FLOPs; tied to the output layer (Llama 3.2 1B), its
matrix is counted once, as the output layer's. torchtitan (torchtitan/tools/utils.py,
`get_num_flop_per_token`) counts 6·(every parameter but the embedding table) + 12·L·h·s: the same
for an untied model up to the norms' gains and the biases (under 0.1 % of W at 1B), and it would
drop a tied model's output layer. `flops_per_token` is checked against PyTorch's own count of a
forward and backward (torch.utils.flop_counter.FlopCounterMode, tests/test_mfu.py): equal.

`measure` runs real training steps (AdamW, bf16 autocast over fp32 master weights) and divides.
refimpl's attention is written out (scores, mask, softmax, @V: refimpl.model.layers), not a fused
flash kernel: its s x s scores go through HBM, so its MFU is lower than a flash-attention model's
at the same shape, which is worth seeing beside torchtitan's published figure.
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import nullcontext

import torch

from refimpl.lab.measure.gpu_names import dense_bf16_peak
from refimpl.lab.predict.hardware import GPUS
from refimpl.memory import training_flops
from refimpl.model import GPTConfig, build_model, count_params, lm_loss

# Llama 3.2 1B as released (meta-llama/Llama-3.2-1B, config.json): 16 layers, d_model 2048, 32
# query and 8 key/value heads, a SwiGLU MLP of width 8192, a 128256-entry vocabulary, the output
# layer tied to the embedding, rotary base 500000. 1,235,814,400 parameters (the model card's
# 1.23B; tests/test_mfu.py counts them). Trained here at 2048 tokens of context, not its 131072:
# refimpl's rotary has no Llama 3 long-context rescaling, which short sequences never reach.
LLAMA_3_2_1B = GPTConfig(arch="llama", vocab_size=128256, seq_len=2048, d_model=2048, n_heads=32,
                         n_layers=16, n_kv_heads=8, ffn_hidden=8192, rope_theta=500000.0,
                         tie_embeddings=True)

# Llama 3.1 8B as torchtitan benchmarked it (torchtitan 9dec370: torchtitan/models/llama/__init__.py
# "8B", train_configs/llama3_8b.toml's seq_len 8192): 32 layers, d_model 4096, 32 query and 8
# key/value heads, SwiGLU width 14336, a 128256-entry vocabulary, an untied output layer.
LLAMA_3_1_8B = GPTConfig(arch="llama", vocab_size=128256, seq_len=8192, d_model=4096, n_heads=32,
                         n_layers=32, n_kv_heads=8, ffn_hidden=14336, rope_theta=500000.0)

# torchtitan's published throughput for it, tokens/s per GPU (benchmarks/llama3_h100_202412_torchtitan.md,
# docs/performance.md until June 2025): Table 1 (8 H100s) and Table 3 (128 H100s), FSDP, bf16, no
# Float8, selective activation checkpointing, local batch 2 x 8192, flash attention. It publishes no
# FLOPs; its text says "33% to 39% MFU (with or without torch.compile, respectively)" against H100
# SXM's dense bf16 peak (its footnote 2), which `torchtitan_mfu` recomputes from these rows.
TORCHTITAN_LLAMA3_8B_TPS = {("eager", 8): 5762, ("compiled", 8): 6667,
                            ("eager", 128): 5605, ("compiled", 128): 6514}


def torchtitan_mfu() -> list[dict]:
    """torchtitan's MFU per published row: its tokens/s per GPU x `flops_per_token` of Llama 3.1 8B
    at 8192 tokens, over H100 SXM's dense bf16 peak (refimpl.lab.predict.hardware), as its footnote does."""
    per_token, peak = flops_per_token(LLAMA_3_1_8B, 8192), GPUS["h100-sxm"].peak_flops
    return [{"mode": mode, "GPUs": gpus, "tokens/s per GPU": tps, "MFU": tps * per_token / peak}
            for (mode, gpus), tps in TORCHTITAN_LLAMA3_8B_TPS.items()]


def matmul_weights(cfg: GPTConfig) -> int:
    """W: the weights that multiply activations, from the shape (the output layer's V x h once,
    tied or not; no embedding table, norm gain or bias). Dense models only."""
    if cfg.n_experts:
        raise ValueError("flops_per_token counts dense models; a MoE's active FLOPs depend on top_k")
    h, layers = cfg.d_model, cfg.n_layers
    if cfg.arch == "llama":
        kv = cfg.kv_heads * cfg.head_dim
        block = 2 * h * h + 2 * h * kv + 3 * h * cfg.swiglu_hidden   # Q, O; K, V; gate, up, down
    else:
        block = 4 * h * h + 2 * h * cfg.mlp_ratio * h                  # Q, K, V, O; up, down
    return layers * block + cfg.vocab_size * h


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs one token needs (forward and backward; the module docstring's formula):
    refimpl.memory.training_flops for one token, with W in place of the parameter count."""
    return int(training_flops(matmul_weights(cfg), 1, n_layers=cfg.n_layers, seq=seq_len,
                              hidden=cfg.d_model))


def peak_flops(device) -> float | None:
    """The dense bf16 peak of `device`, matched on the name CUDA reports
    (refimpl.lab.measure.gpu_names); None for a CPU or a GPU the tables do not have (MFU is then
    not defined here)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return dense_bf16_peak(torch.cuda.get_device_name(device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cfg: GPTConfig = LLAMA_3_2_1B, batch_size: int = 2, seq_len: int | None = None, *,
            steps: int = 8, warmup: int = 2, device="cuda", precision: str = "bf16",
            compile: bool = False, compile_backend: str = "inductor", seed: int = 0) -> dict:
    """Train `cfg` for warmup + steps steps on one device and return its MFU and what it is made of.

    precision "bf16": autocast to bfloat16 over fp32 weights and AdamW state (what FSDP's and
    torchtitan's mixed precision compute in); "fp32": no autocast. compile: each block compiled on
    its own (`nn.Module.compile`, as torchtitan compiles each TransformerBlock): the blocks share
    one code object, so PyTorch compiles once for all of them; `compile_backend` "inductor" (the
    default) or, to trace without generating kernels, "eager" / "aot_eager". The first warm-up
    step holds the compilation: its time is returned apart. Each step ends with a device
    synchronisation, the measurement's boundary; nothing reads a value back inside a step.
    """
    device = torch.device(device)
    seq_len = seq_len or cfg.seq_len
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be bf16 or fp32, not {precision!r}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(cfg, seed, device=device)
    if compile:
        for block in model.blocks:
            block.compile(backend=compile_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (batch_size, seq_len + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def autocast():
        if precision == "fp32":
            return nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    losses, times = [], []
    for _ in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    step_s = statistics.median(times[warmup:])
    per_token = flops_per_token(cfg, seq_len)
    tokens_per_step = batch_size * seq_len
    achieved = per_token * tokens_per_step / step_s
    peak = peak_flops(device)
    losses = [float(x) for x in losses]   # read after the timed steps
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"a loss is not finite: {losses}")
    return {
        "params": count_params(model), "flops_per_token": per_token,
        "tokens_per_step": tokens_per_step, "step_s": step_s, "first_step_s": times[0],
        "tokens_per_s": tokens_per_step / step_s, "achieved_flops": achieved, "peak_flops": peak,
        "mfu": None if peak is None else achieved / peak,
        "loss_first": losses[0], "loss_last": losses[-1],
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "precision": precision, "compiled": compile, "device": str(device),
    }
