"""The rest of the ZeRO family (seed §3.2), as arithmetic: ZeRO++, ZeRO-Infinity, DeepSpeed configs."""
from __future__ import annotations

import json

ZERO3_VOLUME = 3.0   # Ψ per step: forward all-gather + backward all-gather + reduce-scatter


def zeropp_volume(weight_bits: int = 8, grad_bits: int = 4, hierarchical: bool = True,
                  base_bits: int = 16) -> dict:
    """Inter-node volume per rank per step in units of Ψ (of fp16 values), by collective."""
    forward = weight_bits / base_bits
    backward = 0.0 if hierarchical else 1.0
    gradients = grad_bits / base_bits
    return {"forward all-gather": forward, "backward all-gather": backward,
            "gradient reduce-scatter": gradients, "total": forward + backward + gradients}


def hpz_extra_bytes(n_params: float, gpus_per_node: int, bytes_per_param: int = 2) -> float:
    """Bytes per GPU of hpZ's node-local secondary copy of the fp16 weights."""
    return n_params * bytes_per_param / gpus_per_node


# One DGX-2 node, the ZeRO-Infinity paper's testbed (NVIDIA DGX-2 datasheet):
# 16 V100 32 GB, 1.5 TB of DRAM, 30 TB of NVMe.
DGX2 = {"GPU": 16 * 32e9, "CPU": 1.5e12, "NVMe": 30e12}
STATE_BYTES_PER_PARAM = 16


def largest_model(tiers: dict, nodes: int = 1, bytes_per_param: float = STATE_BYTES_PER_PARAM) -> dict:
    """Parameters whose model states fit, using each tier cumulatively (GPU, +CPU, +NVMe)."""
    fit, room = {}, 0.0
    for tier, capacity in tiers.items():
        room += capacity * nodes
        fit[tier] = room / bytes_per_param
    return fit


def nvme_traffic_per_step(n_params: float) -> float:
    """Bytes to and from NVMe per step with every model state there (our count, per step):
    fp16 weights read for forward and again for backward (2 x 2Ψ), fp16 gradients written (2Ψ),
    fp32 master, momentum and variance read and written by the optimizer (2 x 12Ψ), and the new
    fp16 weights written (2Ψ): 32Ψ bytes."""
    return (2 * 2 + 2 + 2 * 12 + 2) * n_params


def tokens_to_hide_nvme(flops_per_s: float, nvme_bytes_per_s: float) -> float:
    """Tokens per GPU per step at which 6Ψ FLOPs per token take as long as moving 32Ψ bytes."""
    return nvme_traffic_per_step(1) * flops_per_s / (6 * nvme_bytes_per_s)


def deepspeed_config(stage: int, offload: str | None = None) -> dict:
    """The `zero_optimization` block of a DeepSpeed config for a stage (DeepSpeed's config docs)."""
    zero = {"stage": stage}
    if offload is not None:
        zero["offload_optimizer"] = {"device": offload}
        if stage == 3:
            zero["offload_param"] = {"device": offload}
    return {"zero_optimization": zero}


def config_lines(cfg: dict) -> list[str]:
    return json.dumps(cfg, indent=2, sort_keys=True).splitlines()


def changed_lines(a: dict, b: dict) -> int:
    """How many lines of the JSON differ between two configs (same length assumed)."""
    la, lb = config_lines(a), config_lines(b)
    return sum(x != y for x, y in zip(la, lb)) + abs(len(la) - len(lb))


# Our flags beside DeepSpeed's stages (python -m refimpl train ...).
OUR_FLAGS = {0: "--strategy dp", 1: "--strategy zero1", 2: "--strategy zero2", 3: "--strategy zero3"}
