"""Training compute at cluster scale: peak rates, PetaFLOP-days, compute-optimal data (seed §1.2).

The FLOP count itself is `refimpl.memory.training_flops` (6·N·D plus attention); this file turns it
into the units and wall-clock figures the seed and the papers quote.

* PetaFLOP-day (seed §1.2; Brown et al. 2020, GPT-3, Appendix D): 10^15 FLOP/s for one day,
  8.64·10^19 FLOPs.
* Model FLOPs utilisation, MFU (Chowdhery et al. 2022, PaLM, §4.1 and Appendix B): achieved model
  FLOPs per second over the hardware's peak.
* Compute-optimal data (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models",
  Chinchilla): about 20 tokens per parameter at the compute-optimal frontier (their Table 3:
  70B parameters -> 1.4T tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

PETAFLOP_DAY = 1e15 * 86400

# Dense (no sparsity) 16-bit tensor-core peaks, from NVIDIA's datasheets: A100 (SXM, 2020) bf16
# 312 TFLOP/s; H100 SXM (2022) bf16 989 TFLOP/s (the datasheet's 1,979 assumes 2:4 sparsity);
# H200 SXM has H100's compute, 989 TFLOP/s, with more and faster HBM (141 GB).
PEAK_BF16_DENSE = {"A100": 312e12, "H100 SXM": 989e12, "H200 SXM": 989e12}

# HBM per GPU, decimal GB as the datasheets print it: A100 80 GB, H100 SXM 80 GB, H200 SXM 141 GB.
HBM_BYTES = {"A100": 80e9, "H100 SXM": 80e9, "H200 SXM": 141e9}

CHINCHILLA_TOKENS_PER_PARAM = 20   # Hoffmann et al. 2022: 70B params trained on 1.4T tokens


def petaflop_days(flops: float) -> float:
    """`flops` in PetaFLOP-days (10^15 FLOP/s sustained for 86,400 s)."""
    return flops / PETAFLOP_DAY


def compute_optimal_tokens(n_params: float, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> float:
    """Tokens a compute-optimal run trains a model of `n_params` on (Chinchilla's rule of thumb)."""
    return n_params * tokens_per_param


@dataclass(frozen=True)
class Cluster:
    """A named cluster: how many GPUs of which kind, for a wall-clock estimate."""

    name: str
    gpu: str
    n_gpus: int

    @property
    def peak_flops(self) -> float:
        return PEAK_BF16_DENSE[self.gpu] * self.n_gpus


def training_days(flops: float, cluster: Cluster, mfu: float) -> float:
    """Wall-clock days to do `flops` on `cluster` at model-FLOPs utilisation `mfu`."""
    return flops / (cluster.peak_flops * mfu) / 86400


def implied_mfu(flops: float, gpu: str, gpu_hours: float) -> float:
    """The MFU a reported GPU-hour budget implies: FLOPs / (peak * seconds)."""
    return flops / (PEAK_BF16_DENSE[gpu] * gpu_hours * 3600)
