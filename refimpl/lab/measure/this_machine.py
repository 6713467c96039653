"""This machine as a Hardware preset for the planner, every number measured here.

`measure_cpu_preset` measures what `cpu_preset` takes, in place of the GPU
presets' datasheet numbers: one thread's matmul rate (what one CPU rank computes at), the fixed
cost of a block pass, one thread's memcpy bandwidth (refimpl.lab.measure.ceilings), and the alpha-beta fit
of torch's all_reduce on gloo ranks (a short refimpl.lab.measure.bench sweep, refimpl.cost.alpha_beta's fit).
"""
from __future__ import annotations

import statistics
import time

import torch

from refimpl.cost.alpha_beta import busbw_factor, fit_alpha_beta, hop_model_from_fit
from refimpl.lab.measure.bench import message_sizes, sweep
from refimpl.lab.measure.ceilings import memcpy_bandwidth
from refimpl.lab.predict.hardware import Hardware
from refimpl.memory import GiB
from refimpl.model import Block, GPTConfig


def cpu_preset(matmul_flops: float, alpha_s: float, beta_bytes_per_s: float,
               memory_bandwidth: float, block_overhead_s: float = 0.0,
               memory_bytes: float = 16 * GiB, overlaps_comm: bool = False,
               step_overhead_s: float = 0.0) -> Hardware:
    """This machine as a 'GPU' for the planner, every number measured here: one rank's matmul rate
    (fraction 1: it is already what a matmul achieves), one thread's memcpy bandwidth, the
    alpha-beta fit of a collective (notebook 02; refimpl.cost.alpha_beta.fit_alpha_beta) and the
    fixed cost of one block pass. All ranks share one machine, so every axis is 'inside the node'."""
    return Hardware("cpu", matmul_flops, memory_bytes, memory_bandwidth,
                    beta_bytes_per_s, beta_bytes_per_s, intra_alpha=alpha_s, inter_alpha=alpha_s,
                    gemm_fraction=1.0, link_fraction=1.0, overlaps_comm=overlaps_comm,
                    block_overhead_s=block_overhead_s, step_overhead_s=step_overhead_s,
                    source="measured on this machine")


def measure_matmul_rate(n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of one thread's fp32 n x n matmul (the rate one CPU rank computes at), best of
    `repeats`: 2n^3 FLOPs per product."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b   # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def measure_block_overhead(repeats: int = 20) -> float:
    """Seconds of one pass of a refimpl.model Block on a one-token input: what a pass costs beyond
    its arithmetic (a forward plus a backward, i.e. three passes, divided by three)."""
    block = Block(GPTConfig())
    x = torch.randn(1, 1, GPTConfig().d_model, requires_grad=True)
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        block(x).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) / 3


def measure_cpu_preset(world_size: int = 2, max_bytes: int = 16 << 20) -> Hardware:
    """Measure what cpu_preset needs: matmul rate, memcpy bandwidth, a block pass's fixed cost, and
    the alpha-beta fit of torch's all_reduce on `world_size` gloo ranks (a short bench.sweep). The
    sweep goes to 16 MiB: up to 4 MiB the latency still dominates on 4 CPU ranks and the fitted
    beta swung from 2 to 30 GB/s between runs on the CI machine (0.75-1.3 GB/s to 16 MiB)."""
    df = sweep(world_sizes=(world_size,), ops=("all_reduce",), impls=("torch",),
               sizes=message_sizes(1 << 10, max_bytes, 4), progress=False, backend="gloo")
    # Fit per-byte-on-the-link time: ring all-reduce time = 2(n-1)/n * M / beta, so multiply M by
    # the bus factor to read beta as the link rate the planner's formulas use.
    link_bytes = df.size_bytes * busbw_factor("all_reduce", world_size)
    alpha, beta = hop_model_from_fit(*fit_alpha_beta(link_bytes, df.time_s), world_size)
    return cpu_preset(measure_matmul_rate(), alpha, beta, memcpy_bandwidth(64 << 20),
                      measure_block_overhead())
