"""What one accelerator and its links can do: the numbers the planner predicts with.

Each GPU preset is per GPU, from NVIDIA's datasheets (the URL next to each). Datasheets quote
NVLink as the bidirectional total; a ring all-reduce sends and receives at the same time, so the
rate one direction carries -- half the quoted total -- is what the alpha-beta model's beta is.
InfiniBand is one ConnectX NIC per GPU in the DGX systems (DGX datasheets): its line rate in
Gb/s / 8 per direction.

Two fractions are assumptions, not datasheet numbers, and are stated here once:
  GEMM_FRACTION = 0.75   large, well-shaped bf16 GEMMs sustain ~70-80% of the tensor-core peak
                         (NVIDIA, "Matrix Multiplication Background User's Guide", Deep Learning
                         Performance docs: A100 GEMM throughput vs size).
  LINK_FRACTION = 0.8    NCCL's all-reduce bus bandwidth reaches ~80% of the link rate on DGX
                         systems (nccl-tests, doc/PERFORMANCE.md, bus bandwidth vs hardware peak).
Latencies (alpha) are orders of magnitude of NCCL's small-message times, also assumptions.
`cpu_preset` replaces every one of these by a measurement on this machine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 2 ** 30

GEMM_FRACTION = 0.75
LINK_FRACTION = 0.8
MEMORY_HEADROOM = 0.9   # fits if predicted bytes <= 90% of capacity: CUDA context, NCCL buffers,
                        # allocator fragmentation and temporary buffers take the rest


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float              # dense bf16 (or the measured matmul rate), FLOP/s
    memory_bytes: float            # HBM capacity
    memory_bandwidth: float        # HBM bytes/s: the rate memory-bound ops and the optimizer run at
    intra_bandwidth: float         # one direction, bytes/s, GPU <-> GPU inside a node (NVLink)
    inter_bandwidth: float         # one direction, bytes/s, per GPU across nodes (InfiniBand)
    intra_alpha: float = 5e-6      # seconds per message step inside a node
    inter_alpha: float = 10e-6     # seconds per message step across nodes
    gemm_fraction: float = GEMM_FRACTION
    link_fraction: float = LINK_FRACTION
    # Can communication run while compute runs? On a GPU, NCCL kernels use their own SMs and
    # streams; CPU ranks with one thread each on fewer cores than ranks cannot hide anything.
    overlaps_comm: bool = True
    # Fixed cost of one block's pass per micro-batch (Python, op dispatch, kernel launches):
    # negligible against a GPU's large GEMMs, dominant for the tiny model on CPU.
    block_overhead_s: float = 0.0
    source: str = ""

    @property
    def matmul_rate(self) -> float:
        return self.peak_flops * self.gemm_fraction

    def link(self, within_node: bool) -> tuple[float, float]:
        """(alpha seconds, achievable bytes/s) of a ring that stays inside a node or leaves it."""
        if within_node:
            return self.intra_alpha, self.intra_bandwidth * self.link_fraction
        return self.inter_alpha, self.inter_bandwidth * self.link_fraction


GPUS = {
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # A100 80GB SXM: BF16 tensor core 312 TFLOPS (dense), HBM2e 2,039 GB/s, NVLink 600 GB/s;
    # DGX A100: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU.
    "a100-80gb": Hardware("a100-80gb", 312e12, 80 * GiB, 2.039e12, 300e9, 200e9 / 8,
                          source="NVIDIA A100 datasheet; DGX A100 datasheet"),
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    # H100 SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, HBM3 3.35 TB/s, NVLink 900 GB/s;
    # DGX H100: 8x ConnectX-7 400 Gb/s NDR, one per GPU.
    "h100-sxm": Hardware("h100-sxm", 989e12, 80 * GiB, 3.35e12, 450e9, 400e9 / 8,
                         source="NVIDIA H100 datasheet; DGX H100 datasheet"),
    # https://www.nvidia.com/en-us/data-center/h200/
    # H200 SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s; DGX H200: 8x ConnectX-7 400 Gb/s.
    "h200": Hardware("h200", 989e12, 141e9, 4.8e12, 450e9, 400e9 / 8,
                     source="NVIDIA H200 datasheet; DGX H200 datasheet"),
}


def get_hardware(gpu) -> Hardware:
    if isinstance(gpu, Hardware):
        return gpu
    try:
        return GPUS[gpu]
    except KeyError:
        raise ValueError(f"unknown gpu {gpu!r}; presets: {sorted(GPUS)}") from None


# --- this machine -------------------------------------------------------------------------------

def measure_matmul_rate(n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of one thread's fp32 n x n matmul (the rate one CPU rank computes at), best of
    `repeats`: 2n^3 FLOPs per product."""
    import time

    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b   # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def cpu_preset(matmul_flops: float, alpha_s: float, beta_bytes_per_s: float,
               memory_bandwidth: float, block_overhead_s: float = 0.0,
               memory_bytes: float = 16 * GiB, overlaps_comm: bool = False) -> Hardware:
    """This machine as a 'GPU' for the planner, every number measured here: one rank's matmul rate
    (fraction 1: it is already what a matmul achieves), one thread's memcpy bandwidth, the
    alpha-beta fit of a collective (notebook 02; refimpl.cost.bench.fit_alpha_beta) and the fixed
    cost of one block pass. All ranks share one machine, so every axis is 'inside the node'."""
    return Hardware("cpu", matmul_flops, memory_bytes, memory_bandwidth,
                    beta_bytes_per_s, beta_bytes_per_s, intra_alpha=alpha_s, inter_alpha=alpha_s,
                    gemm_fraction=1.0, link_fraction=1.0, overlaps_comm=overlaps_comm,
                    block_overhead_s=block_overhead_s, source="measured on this machine")


def measure_block_overhead(repeats: int = 20) -> float:
    """Seconds of one pass of a refimpl.model Block on a one-token input: what a pass costs beyond
    its arithmetic (a forward plus a backward, i.e. three passes, divided by three)."""
    import statistics
    import time

    import torch

    from refimpl.model import Block, GPTConfig

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
    from refimpl.cost.bench import busbw_factor, fit_alpha_beta, memcpy_bandwidth, message_sizes, sweep

    df = sweep(world_sizes=(world_size,), ops=("all_reduce",), impls=("torch",),
               sizes=message_sizes(1 << 10, max_bytes, 4), progress=False, backend="gloo")
    # Fit per-byte-on-the-link time: ring all-reduce time = 2(n-1)/n * M / beta, so divide M by
    # the bus factor's inverse to read beta as the link rate the planner's formulas use.
    link_bytes = df.size_bytes * busbw_factor("all_reduce", world_size)
    alpha, beta = fit_alpha_beta(link_bytes, df.time_s)
    return cpu_preset(measure_matmul_rate(), alpha / (2 * (world_size - 1)), beta,
                      memcpy_bandwidth(64 << 20), measure_block_overhead())


def with_overrides(hw: Hardware, **changes) -> Hardware:
    return replace(hw, **changes)
