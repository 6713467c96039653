"""The dense bf16 peak of the GPU CUDA names, for MFU: the presets of refimpl.lab.predict.hardware plus
the boards that have none (PCIe and NVL cards: the same die at lower power and clock).

The datasheets quote bf16 "with sparsity"; dense is half of it: H100 NVL and H200 NVL 1,671
TFLOPS*, H100 PCIe 1,513 TFLOPS* (NVIDIA's H100 and H200 datasheets)."""
from __future__ import annotations

from refimpl.lab.predict.hardware import GPUS

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
