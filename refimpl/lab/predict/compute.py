"""Training compute at cluster scale: PetaFLOP-days, compute-optimal data, days on a cluster (seed §1.2)."""
from __future__ import annotations

from dataclasses import dataclass

from refimpl.lab.predict.hardware import get_hardware

PETAFLOP_DAY = 1e15 * 86400

CHINCHILLA_TOKENS_PER_PARAM = 20   # Hoffmann et al. 2022: 70B params trained on 1.4T tokens


def petaflop_days(flops: float) -> float:
    """`flops` in PetaFLOP-days (10^15 FLOP/s sustained for 86,400 s)."""
    return flops / PETAFLOP_DAY


def compute_optimal_tokens(n_params: float, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> float:
    """Tokens a compute-optimal run trains a model of `n_params` on (Chinchilla's rule of thumb)."""
    return n_params * tokens_per_param


@dataclass(frozen=True)
class Cluster:
    """A named cluster: how many GPUs of which kind (a refimpl.lab.predict.hardware preset)."""

    name: str
    gpu: str
    n_gpus: int

    @property
    def peak_flops(self) -> float:
        return get_hardware(self.gpu).peak_flops * self.n_gpus


def training_days(flops: float, flops_per_second: float, n_devices: int = 1,
                  utilization: float = 1.0) -> float:
    """Wall-clock days at a given per-device rate and model-FLOPs utilisation."""
    return flops / (flops_per_second * n_devices * utilization) / 86400


def days_on_cluster(flops: float, cluster: Cluster, mfu: float) -> float:
    """Wall-clock days to do `flops` on `cluster` at model-FLOPs utilisation `mfu`."""
    return training_days(flops, get_hardware(cluster.gpu).peak_flops, cluster.n_gpus, mfu)


def implied_mfu(flops: float, gpu: str, gpu_hours: float) -> float:
    """The MFU a reported GPU-hour budget on `gpu` (a preset) implies: FLOPs / (peak * seconds)."""
    return flops / (get_hardware(gpu).peak_flops * gpu_hours * 3600)
