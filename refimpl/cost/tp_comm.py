"""What tensor parallelism costs on the wire, and why it stays inside a node (seed §3.3 단점; 003).

Bytes. Per transformer layer and micro-batch, 2 all-reduces of the b·s·h activation in forward and
2 in backward (Megatron-LM's f and g); a ring all-reduce of M bytes sends 2(t-1)/t·M per rank, so
each rank sends 8·b·s·h·(t-1)/t values per layer per micro-batch (Narayanan et al. 2021, §3.3,
"Tensor and Pipeline Model Parallelism": counted in values, per device; times bytes per value here).
Sequence parallelism replaces each all-reduce by an all-gather + a reduce-scatter, (t-1)/t·M each:
the same bytes in twice the calls (Korthikanti et al. 2022, §4.2.2).

Time. A ring all-reduce over t ranks is 2(t-1) steps, each a latency α_hop plus a chunk of M/t
bytes at the link bandwidth B: T = 2(t-1)·α_hop + 2(t-1)/t · M/B (Patarasuk & Yuan 2009;
refimpl.cost.alpha_beta.ring_seconds). An α-β fit at t = 2 (T = α + M/β,
refimpl.cost.alpha_beta.fit_alpha_beta) gives α_hop = α/2 and B = β (alpha_beta.hop_model_from_fit),
from which the same model predicts other t.

Compute, to compare with. One layer's forward is 24·b·s·h² + 4·b·s²·h FLOPs (Narayanan et al.
2021, §5.1: the four h×h-sized matmuls and the 4h MLP, plus scores and S·V); backward twice that:
72·b·s·h²·(1 + s/(6h)) per layer, split t ways under TP.

Links and peak rates come from the planner's GPU presets (refimpl.cost.hardware: the datasheet
numbers and their sources, written once): NVLink inside a node, one InfiniBand port per GPU across
nodes, the dense BF16 peak.
"""
from __future__ import annotations

from dataclasses import dataclass

from refimpl.cost.alpha_beta import ring_seconds
from refimpl.cost.hardware import get_hardware


def bytes_per_layer(b: int, s: int, h: int, t: int, dtype_bytes: int = 2) -> float:
    """Bytes one rank sends per layer per micro-batch, forward + backward (Narayanan 2021)."""
    return 8 * b * s * h * (t - 1) / t * dtype_bytes


def calls_per_layer(sequence_parallel: bool = False) -> dict:
    """Collectives per layer per micro-batch, forward + backward."""
    if sequence_parallel:
        return {"all_gather": 4, "reduce_scatter": 4}
    return {"all_reduce": 4}


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
    """TP communication time / compute time per layer on `gpu` (a refimpl.cost.hardware preset),
    its ring inside a node (NVLink) or across nodes (InfiniBand). The best case for the link:
    datasheet rates, no latency, nothing overlapped. > 1: the GPUs wait longer than they compute."""
    hw = get_hardware(gpu)
    link = hw.intra_bandwidth if within_node else hw.inter_bandwidth
    compute = flops_per_layer(shape) / t / hw.peak_flops
    return comm_seconds_per_layer(shape, t, 0.0, link) / compute
