"""What one accelerator and its links can do: the one table of GPU datasheet numbers."""
from __future__ import annotations

from dataclasses import dataclass

from refimpl.cost.links import gbit, nvlink_bytes_per_s
from refimpl.memory import GiB

GEMM_FRACTION = 0.75
LINK_FRACTION = 0.8
MIB = 2 ** 20
MEMORY_HEADROOM = 0.9   # fits if predicted bytes <= 90% of capacity: CUDA context, NCCL buffers,
                        # allocator fragmentation and temporary buffers take the rest


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
    # Can communication run while compute runs? On a GPU, NCCL kernels use their own SMs and
    # streams; CPU ranks with one thread each on fewer cores than ranks cannot hide anything.
    overlaps_comm: bool = True
    # Fixed cost of one block's pass per micro-batch (Python, op dispatch, kernel launches):
    # negligible against a GPU's large GEMMs, dominant for the tiny model on CPU.
    block_overhead_s: float = 0.0
    # Fixed cost of one step whatever its micro-batches (the loop's Python around the step: the
    # optimizer call, zeroing, the loss's reduction): nothing on a GPU preset, measured on CPU.
    step_overhead_s: float = 0.0
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
    # DGX A100: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU. nvidia-smi: 81920 MiB.
    "a100-80gb": Hardware("a100-80gb", 312e12, 81920 * MIB, 2.039e12, nvlink_bytes_per_s(12), gbit(200),
                          source="NVIDIA A100 datasheet; DGX A100 datasheet"),
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    # H100 SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, HBM3 3.35 TB/s, NVLink 900 GB/s;
    # DGX H100: 8x ConnectX-7 400 Gb/s NDR, one per GPU. nvidia-smi: 81559 MiB.
    "h100-sxm": Hardware("h100-sxm", 989e12, 81559 * MIB, 3.35e12, nvlink_bytes_per_s(18), gbit(400),
                         source="NVIDIA H100 datasheet; DGX H100 datasheet"),
    # https://www.nvidia.com/en-us/data-center/h200/
    # H200 SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s; DGX H200: 8x ConnectX-7 400 Gb/s. nvidia-smi: 143771 MiB.
    "h200": Hardware("h200", 989e12, 143771 * MIB, 4.8e12, nvlink_bytes_per_s(18), gbit(400),
                     source="NVIDIA H200 datasheet; DGX H200 datasheet"),
}


# Dense bf16 tensor-core peaks of the parts with no preset above (the presets are SXM boards, as
# DGX/HGX nodes hold them). The datasheets quote bf16 "with sparsity"; dense is half of it:
#   H100 NVL: 1,671 TFLOPS* (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet,
#             the H100 SXM | H100 NVL columns: 1,979* | 1,671*)
#   H200 NVL: 1,671 TFLOPS* (https://www.nvidia.com/en-us/data-center/h200/, H200 SXM | H200 NVL:
#             1,979* | 1,671*)
#   H100 PCIe: 1,513 TFLOPS* (the first H100 datasheet's PCIe column)
# NVL and PCIe boards are PCIe cards run at a lower power (350-600 W against the SXM's 700 W) and
# clock: the same GH100 die, 16 % (NVL) to 24 % (PCIe) below the SXM part's 989 dense.
DENSE_BF16_PEAKS = {"h100-nvl": 1671e12 / 2, "h200-nvl": 1671e12 / 2, "h100-pcie": 1513e12 / 2}


def part_of(cuda_name: str) -> str | None:
    """The part a CUDA device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL",
    "NVIDIA A100-SXM4-80GB") names, as a key of GPUS or DENSE_BF16_PEAKS; None when unknown.
    Matched on whole words: "NVL" and "PCIe" are their own words in the names CUDA reports, and a
    GH200 (a word of its own) is not an H200."""
    words = cuda_name.lower().replace("-", " ").split()
    form = "nvl" if "nvl" in words else "pcie" if "pcie" in words else None
    if "h200" in words:
        return f"h200-{form}" if form else "h200"
    if "h100" in words:
        return f"h100-{form}" if form else "h100-sxm"
    if "a100" in words and "80gb" in words:
        return "a100-80gb"
    return None


def dense_bf16_peak(cuda_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of the device CUDA names so; None for a part not tabled here."""
    part = part_of(cuda_name)
    if part in GPUS:
        return GPUS[part].peak_flops
    return DENSE_BF16_PEAKS.get(part)


def get_hardware(gpu) -> Hardware:
    if isinstance(gpu, Hardware):
        return gpu
    try:
        return GPUS[gpu]
    except KeyError:
        raise ValueError(f"unknown gpu {gpu!r}; presets: {sorted(GPUS)}") from None


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
