"""When ring attention's K/V transfer hides under its block compute (notebook 09 §3).

At each of the cp - 1 ring steps a rank computes one block of scores, its c = s/cp queries against
the c keys it holds (Q·Kᵀ and P·V: 4·b·c²·h FLOPs forward), while the next K and V blocks
(2·b·c·h_kv values) arrive from its neighbour. The transfer is hidden when the block compute takes
at least as long: 4·b·c²·h / rate ≥ 2·b·c·h_kv·bytes / bandwidth, i.e. a chunk of at least
c ≥ bytes·rate·h_kv / (2·bandwidth·h) tokens (Liu et al. 2023, "Ring Attention with Blockwise
Transformers", §3: the block size must exceed FLOPs / bandwidth). Rates are a preset's achievable
ones (refimpl.cost.hardware: Hardware.matmul_rate, Hardware.link).
"""
from __future__ import annotations

from refimpl.cost.hardware import Hardware, get_hardware


def ring_step_seconds(b: int, c: int, h: int, gpu: str | Hardware, within_node: bool = True, *,
                      kv_fraction: float = 1.0, dtype_bytes: int = 2) -> tuple[float, float]:
    """(block compute seconds, K/V transfer seconds) of one ring step, forward. `kv_fraction`:
    key/value width over model width (grouped-query attention: kv heads / query heads)."""
    hw = gpu if isinstance(gpu, Hardware) else get_hardware(gpu)
    alpha, link = hw.link(within_node)
    compute = 4 * b * c * c * h / hw.matmul_rate
    transfer = alpha + 2 * b * c * h * kv_fraction * dtype_bytes / link
    return compute, transfer


def min_overlap_chunk(gpu: str | Hardware, within_node: bool = True, *, kv_fraction: float = 1.0,
                      dtype_bytes: int = 2) -> float:
    """The shortest chunk (tokens per rank) whose block compute covers the K/V transfer (latency
    left out): bytes·rate·kv_fraction / (2·bandwidth)."""
    hw = gpu if isinstance(gpu, Hardware) else get_hardware(gpu)
    _, link = hw.link(within_node)
    return dtype_bytes * hw.matmul_rate * kv_fraction / (2 * link)
