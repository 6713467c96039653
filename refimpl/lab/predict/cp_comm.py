"""When ring attention's K/V transfer hides under its block compute (notebook 09 §3)."""
from __future__ import annotations

from refimpl.lab.predict.hardware import Hardware, get_hardware
from refimpl.memory import block_activation_bytes


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


def rank_activation_bytes(model, rows: int, seq: int, cp: int = 1, *, dtype_bytes: int = 4,
                          id_rows: int | None = None) -> int:
    """What autograd saves for one forward of refimpl.model.GPT and its loss on one rank of a cp
    ring: `rows` sequences of `seq` tokens, this rank holding seq/cp of each (cp = 1: the plain
    model, exactly refimpl.memory.block_activation_bytes per block).

    Per block, ring attention (refimpl.parallel.cp.ring.RingAttention) saves q, k, v, its output
    and a fp32 log-sum-exp per query and head instead of the softmax probabilities and the causal
    mask, the only s² terms: what is left shrinks as 1/cp. Its output is saved once more than in
    the plain block (the softmax backward's correction term needs it, FlashAttention's D = rowsum
    dO∘O). Outside the blocks: the token ids and the positions looked up (int64), the final
    LayerNorm's input, output and statistics, the log-softmax of the logits, the targets (int64),
    and one fp32 scalar of the loss. `id_rows`: rows in the storage the ids are views of (the
    micro-batches of a rank's batch share its storage; default `rows`).
    """
    s, b, h, a = seq // cp, rows, model.d_model, model.n_heads
    sbh, sb = s * b * h, s * b
    block = block_activation_bytes(s, b, h, a, mlp_ratio=model.mlp_ratio, dtype_bytes=dtype_bytes)
    acc = max(4, dtype_bytes)    # statistics and the log-sum-exp: at least fp32
    if cp > 1:
        block += ring_block_delta_bytes(s, b, h, a, dtype_bytes=dtype_bytes)
    ids = 2 * (id_rows or rows) * s * 8 + s * 8
    outside = 2 * sbh * dtype_bytes + 2 * sb * acc + sb * model.vocab_size * dtype_bytes + ids + acc
    return model.n_layers * block + outside


def ring_block_delta_bytes(seq: int, batch: int, hidden: float, heads: float, *,
                           dtype_bytes: int = 4) -> float:
    """What one block saves under ring attention minus what the plain block saves, on a rank's
    `seq` tokens (refimpl.parallel.cp.ring.RingAttention): its output O once more (+s·b·h: the
    block's output projection saves its own contiguous copy of O), a log-sum-exp per query and head
    (+a·s·b, at least fp32), and neither the softmax probabilities (-a·s²·b) nor the s×s bool
    causal mask (-s²). On a tensor-parallel rank pass its hidden/t and heads/t: the mask is the
    one term that is not split."""
    s, b = seq, batch
    return (s * b * hidden * dtype_bytes + heads * s * b * max(4, dtype_bytes)
            - heads * s * s * b * dtype_bytes - s * s)
