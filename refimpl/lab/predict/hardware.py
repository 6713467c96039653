"""The one table of GPU datasheet numbers: dense bf16 peak ("with sparsity" halved), HBM capacity
(as nvidia-smi reports it) and bandwidth, NVLink and one InfiniBand NIC per GPU, per direction; with
the shares of them the planner assumes reachable (refimpl.lab.plan predicts with these presets)."""
from __future__ import annotations

from dataclasses import dataclass

GEMM_FRACTION = 0.75
LINK_FRACTION = 0.8
MIB = 2 ** 20
MEMORY_HEADROOM = 0.9   # fits if predicted bytes <= 90% of capacity (context, buffers, fragmentation)
NVLINK = 25e9           # bytes/s per NVLink link, one direction
GBIT = 1e9 / 8          # bytes/s in one Gb/s


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float              # dense bf16 (or the measured matmul rate), FLOP/s
    memory_bytes: float            # HBM capacity as the driver reports it (bytes; see MIB)
    memory_bandwidth: float        # HBM bytes/s: the rate memory-bound ops and the optimizer run at
    intra_bandwidth: float         # one direction, bytes/s, GPU <-> GPU inside a node (NVLink)
    inter_bandwidth: float         # one direction, bytes/s, per GPU across nodes (InfiniBand)
    intra_alpha: float = 5e-6      # seconds per message step inside a node
    inter_alpha: float = 10e-6     # seconds per message step across nodes
    gemm_fraction: float = GEMM_FRACTION
    link_fraction: float = LINK_FRACTION
    overlaps_comm: bool = True     # can communication hide under compute (a GPU: yes)
    block_overhead_s: float = 0.0  # fixed cost of one block pass per micro-batch (CPU: measured)
    step_overhead_s: float = 0.0   # fixed cost of one step (CPU: measured)
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
    # A100 80GB SXM: 312 TFLOPS bf16, HBM2e 2,039 GB/s, 12 NVLinks; DGX A100: HDR 200 Gb/s per GPU
    "a100-80gb": Hardware("a100-80gb", 312e12, 81920 * MIB, 2.039e12, 12 * NVLINK, 200 * GBIT,
                          source="NVIDIA A100 datasheet; DGX A100 datasheet"),
    # H100 SXM: 989 TFLOPS dense bf16, HBM3 3.35 TB/s, 18 NVLinks; DGX H100: NDR 400 Gb/s per GPU
    "h100-sxm": Hardware("h100-sxm", 989e12, 81559 * MIB, 3.35e12, 18 * NVLINK, 400 * GBIT,
                         source="NVIDIA H100 datasheet; DGX H100 datasheet"),
    # H200 SXM: 989 TFLOPS dense bf16, 141 GB HBM3e at 4.8 TB/s, 18 NVLinks; DGX H200: 400 Gb/s
    "h200": Hardware("h200", 989e12, 143771 * MIB, 4.8e12, 18 * NVLINK, 400 * GBIT,
                     source="NVIDIA H200 datasheet; DGX H200 datasheet"),
}


def get_hardware(gpu) -> Hardware:
    if isinstance(gpu, Hardware):
        return gpu
    try:
        return GPUS[gpu]
    except KeyError:
        raise ValueError(f"unknown gpu {gpu!r}; presets: {sorted(GPUS)}") from None
