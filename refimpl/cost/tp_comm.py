"""What tensor parallelism costs on the wire, and why it stays inside a node (seed §3.3 단점; 003).

Bytes. Per transformer layer and micro-batch, 2 all-reduces of the b·s·h activation in forward and
2 in backward (Megatron-LM's f and g); a ring all-reduce of M bytes sends 2(t-1)/t·M per rank, so
each rank sends 8·b·s·h·(t-1)/t values per layer per micro-batch (Narayanan et al. 2021, §3.3,
"Tensor and Pipeline Model Parallelism": counted in values, per device; times bytes per value here).
Sequence parallelism replaces each all-reduce by an all-gather + a reduce-scatter, (t-1)/t·M each:
the same bytes in twice the calls (Korthikanti et al. 2022, §4.2.2).

Time. A ring all-reduce over t ranks is 2(t-1) steps, each a latency α_hop plus a chunk of M/t
bytes at the link bandwidth B: T = 2(t-1)·α_hop + 2(t-1)/t · M/B (Patarasuk & Yuan 2009). An
α-β fit at t = 2 (T = α + M/β, refimpl.cost.bench.fit_alpha_beta) gives α_hop = α/2 and B = β,
from which the same model predicts other t.

Compute, to compare with. One layer's forward is 24·b·s·h² + 4·b·s²·h FLOPs (Narayanan et al.
2021, §5.1: the four h×h-sized matmuls and the 4h MLP, plus scores and S·V); backward twice that:
72·b·s·h²·(1 + s/(6h)) per layer, split t ways under TP.

Links and peak rates come from the planner's GPU presets (refimpl.plan.hardware, datasheet
sources there): e.g. H100 SXM, NVLink 4 at 450 GB/s each way (900 GB/s bidirectional), one 400 Gb/s
NDR InfiniBand port per GPU (50 GB/s each way), 989 TFLOP/s dense BF16.
"""
from __future__ import annotations

from dataclasses import dataclass


def bytes_per_layer(b: int, s: int, h: int, t: int, dtype_bytes: int = 2) -> float:
    """Bytes one rank sends per layer per micro-batch, forward + backward (Narayanan 2021)."""
    return 8 * b * s * h * (t - 1) / t * dtype_bytes


def calls_per_layer(sequence_parallel: bool = False) -> dict:
    """Collectives per layer per micro-batch, forward + backward."""
    if sequence_parallel:
        return {"all_gather": 4, "reduce_scatter": 4}
    return {"all_reduce": 4}


def ring_seconds(op: str, message_bytes: float, t: int, alpha_hop: float,
                 link_bytes_per_s: float) -> float:
    """Time of one ring collective of a `message_bytes` tensor over t ranks (Patarasuk & Yuan)."""
    steps = {"all_reduce": 2 * (t - 1), "all_gather": t - 1, "reduce_scatter": t - 1}[op]
    return steps * (alpha_hop + message_bytes / t / link_bytes_per_s)


def hop_model_from_fit(alpha_s: float, beta_bytes_per_s: float) -> tuple[float, float]:
    """(α_hop, B) from an all-reduce fit T = α + M/β measured on 2 ranks: T = 2α_hop + M/B."""
    return alpha_s / 2, beta_bytes_per_s


@dataclass(frozen=True)
class LayerShape:
    b: int
    s: int
    h: int
    dtype_bytes: int = 2


def comm_seconds_per_layer(shape: LayerShape, t: int, alpha_hop: float, link: float,
                           sequence_parallel: bool = False) -> float:
    message = shape.b * shape.s * shape.h * shape.dtype_bytes
    return sum(n * ring_seconds(op, message, t, alpha_hop, link)
               for op, n in calls_per_layer(sequence_parallel).items())


def flops_per_layer(shape: LayerShape) -> float:
    """Forward + backward FLOPs of one layer, whole (divide by t for one TP rank)."""
    b, s, h = shape.b, shape.s, shape.h
    return 72 * b * s * h * h * (1 + s / (6 * h))


def comm_to_compute(shape: LayerShape, t: int, gpu: str = "h100-sxm",
                    within_node: bool = True) -> float:
    """TP communication time / compute time per layer on `gpu` (a refimpl.plan.hardware preset),
    its ring inside a node (NVLink) or across nodes (InfiniBand). The best case for the link:
    datasheet rates, no latency, nothing overlapped. > 1: the GPUs wait longer than they compute."""
    from refimpl.plan.hardware import get_hardware

    hw = get_hardware(gpu)
    link = hw.intra_bandwidth if within_node else hw.inter_bandwidth
    compute = flops_per_layer(shape) / t / hw.peak_flops
    return comm_seconds_per_layer(shape, t, 0.0, link) / compute
