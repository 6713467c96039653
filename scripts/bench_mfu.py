"""Model FLOPs utilisation of one device training refimpl's model, eager and compiled (refimpl.lab.measure.mfu).

    .venv/bin/python scripts/bench_mfu.py                       # a GPU: Llama 3.2 1B shape, bf16
    .venv/bin/python scripts/bench_mfu.py --batch 4 --seq 1024  # other shapes of the batch
    .venv/bin/python scripts/bench_mfu.py --device cpu          # the tiny Llama-shaped test model

Prints per mode (eager, each block compiled): step time, tokens/s, model TFLOP/s, MFU against the
device's datasheet peak (refimpl.lab.predict.hardware; "n/a" on a CPU or a GPU the table lacks), peak
memory, and torchtitan's MFU beside it (from its published tokens/s). On a CPU the model is the
small one the tests train (a 1B model would take minutes a step) and compiling is off unless
--compile asks for it (inductor's CPU code generation alone takes ~30 s). A benchmark, not a test:
it asserts nothing.
"""
from __future__ import annotations

import argparse

import torch

from refimpl.lab.measure import mfu
from refimpl.model import GPTConfig

# What --device cpu trains: refimpl's default test model in Llama's block (GQA with 2 K/V heads).
SMALL_LLAMA = GPTConfig(arch="llama", n_kv_heads=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (GPU 2, CPU 4)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (GPU 2048, CPU 64)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                   help="default bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--compile", choices=("both", "eager", "compiled"), default=None,
                   help="which modes to run (default: both on a GPU, eager on a CPU)")
    args = p.parse_args(argv)

    gpu = torch.device(args.device).type == "cuda"
    cfg = mfu.LLAMA_3_2_1B if gpu else SMALL_LLAMA
    batch, seq = args.batch or (2 if gpu else 4), args.seq or (2048 if gpu else 64)
    precision = args.precision or ("bf16" if gpu else "fp32")
    modes = {"both": (False, True), "eager": (False,), "compiled": (True,)}[args.compile or ("both" if gpu else "eager")]
    if seq > cfg.seq_len:
        p.error(f"--seq {seq} exceeds the model's context ({cfg.seq_len})")

    print(f"{args.device}: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
          f"({cfg.kv_heads} K/V), vocabulary {cfg.vocab_size}; batch {batch} x {seq}, {precision}; "
          f"{mfu.flops_per_token(cfg, seq) / 1e9:.3f} GFLOP per token (6 W + 12 L h s)")
    print(f"{'mode':<16} {'params':>9} {'ms/step':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>7} "
          f"{'peak GiB':>9} {'1st step s':>10} {'loss':>15}")
    for compiled in modes:
        r = mfu.measure(cfg, batch, seq, steps=args.steps, device=args.device, precision=precision,
                        compile=compiled)
        util = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        peak = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.1f}"
        print(f"{'compiled blocks' if compiled else 'eager':<16} {r['params'] / 1e6:>8.1f}M "
              f"{r['step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>10,.0f} {r['achieved_flops'] / 1e12:>8.2f} "
              f"{util:>7} {peak:>9} {r['first_step_s']:>10.1f} "
              f"{r['loss_first']:>7.3f}->{r['loss_last']:.3f}")
    titan = ", ".join(f"{r['mode']} on {r['GPUs']} {r['MFU']:.0%}" for r in mfu.torchtitan_mfu())
    print(f"\ntorchtitan (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3), Llama 3.1 8B "
          f"with FSDP on 8 and 128 H100s, bf16, flash attention; MFU from its published tokens/s per "
          f"GPU with the FLOPs per token above: {titan}. A different model on many GPUs, compared as a "
          "share of the peak; refimpl's attention is written out (its s x s scores go through "
          "memory): expect less at the same shape.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
