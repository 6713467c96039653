"""Check the planner's GPU assumptions on the GPU this runs on, and ring attention's CUDA path.

    python scripts/gpu_plan_check.py [--preset h200] [--json out.json]

Prints, as one JSON object:
  * the bf16 GEMM rate of large square matmuls, and its fraction of the preset's datasheet peak
    (the planner assumes refimpl.lab.predict.hardware.GEMM_FRACTION);
  * the HBM copy bandwidth (read + write bytes / s) against the preset's datasheet number;
  * ring attention on one rank (cp = 1, no communication) on this device, forward and gradients,
    against refimpl.model.attention: the relative errors in fp32.
On a machine without CUDA it runs the same code on CPU at small sizes (a smoke test only).
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def _timed(fn, device, repeats=10) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gemm_rate(device, n: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _timed(lambda: a @ b, device)


def copy_bandwidth(device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device)


def ring_attention_errors(device) -> dict:
    from refimpl.model import attention
    from refimpl.parallel.cp.ring import ring_attention

    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 256, 8 * 64, generator=g).to(device) for _ in range(4))
    out = {}
    for name, fn in (("ring", ring_attention), ("reference", attention)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves, 8)
        o.backward(grad)
        out[name] = [o.detach()] + [t.grad for t in leaves]
    names = ("out", "dq", "dk", "dv")
    return {f"{n}_rel_err": float((a - b).norm() / b.norm())
            for n, a, b in zip(names, out["ring"], out["reference"])}


def main() -> None:
    from refimpl.lab.predict.hardware import GPUS

    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="h200", choices=sorted(GPUS))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    big = device.type == "cuda"
    hw = GPUS[args.preset]
    rate = gemm_rate(device, 8192 if big else 512)
    bandwidth = copy_bandwidth(device, (2 << 30) if big else (64 << 20))
    result = {"device": torch.cuda.get_device_name() if big else "cpu", "preset": hw.name,
              "gemm_flops": rate, "gemm_fraction_of_peak": rate / hw.peak_flops,
              "assumed_gemm_fraction": hw.gemm_fraction,
              "hbm_bytes_per_s": bandwidth, "hbm_fraction_of_datasheet": bandwidth / hw.memory_bandwidth,
              **ring_attention_errors(device)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
