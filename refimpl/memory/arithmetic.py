"""Memory and compute arithmetic of training: what theory predicts (refimpl.memory.measured holds
the same quantities measured on a live model).

  model_state_bytes         params + grads + optimizer states per rank, plain DP and ZeRO 1/2/3
  activation_bytes_per_layer  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
                            Transformer Models", Table 2 (16-bit activations)
  training_flops            6·N·D (Kaplan et al. 2020) plus the attention term (PaLM, App. B)

"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GB = 1e9   # the papers and the seed use decimal gigabytes
GiB = 2 ** 30


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def shard_numel(n: int, dp: int) -> int:
    """Elements one rank holds of a flat tensor of n elements split dp ways (last shard padded)."""
    return math.ceil(n / dp)


def model_state_bytes(n_params: int, *, dp: int = 1, zero_stage: int = 0, param_bytes: float = 2,
                      grad_bytes: float = 2, optimizer_bytes: float = 12,
                      padded: bool = True) -> ModelStateBytes:
    """Bytes of model states one data-parallel rank holds (ZeRO paper, Rajbhandari et al. 2020, §3-5).

    Defaults are mixed-precision Adam: 2-byte params and grads, and K = 12 bytes of optimizer state
    per parameter (fp32 master copy + momentum + variance), the paper's accounting. The seed counts
    only Adam's two moments: optimizer_bytes=8. Plain fp32 AdamW is param_bytes=grad_bytes=4,
    optimizer_bytes=8.

    Stage 1 shards the optimizer states over dp ranks, stage 2 also the gradients, stage 3 also the
    parameters. With `padded` (and dp > 1, zero_stage >= 1) the count is what flat-buffer
    implementations allocate (refimpl.parallel.dp.flat_param): a shard is S = ceil(N/dp) elements and
    an unsharded flat buffer dp·S, the zero padding that makes every rank's shard equal. Without
    (and for plain DP, which shards nothing and so pads nothing), exactly N/dp and N.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if padded and dp > 1 and zero_stage >= 1:
        shard = shard_numel(n_params, dp)
        full = shard * dp
    else:
        shard, full = n_params / dp, n_params
    return ModelStateBytes(
        params=(shard if zero_stage >= 3 else full) * param_bytes,
        grads=(shard if zero_stage >= 2 else full) * grad_bytes,
        optimizer=(shard if zero_stage >= 1 else full) * optimizer_bytes,
    )


def sharded_state_bytes(unit_sizes, *, dp: int, zero_stage: int = 3, param_bytes: float = 4,
                        grad_bytes: float = 4, optimizer_bytes: float = 8) -> ModelStateBytes:
    """model_state_bytes summed over units that are each flattened and padded on their own.

    ZeRO-3 / FSDP shard unit by unit (one flat buffer per transformer block, ...), so each unit
    pads to a multiple of dp separately: sum_u ceil(n_u/dp), which can exceed ceil(N/dp).
    """
    parts = [model_state_bytes(n, dp=dp, zero_stage=zero_stage, param_bytes=param_bytes,
                               grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
             for n in unit_sizes]
    return ModelStateBytes(params=sum(p.params for p in parts), grads=sum(p.grads for p in parts),
                           optimizer=sum(p.optimizer for p in parts))


def zero_state_bytes(unit_sizes, *, dp: int, zero_stage: int, param_bytes: float = 4,
                     grad_bytes: float = 4, optimizer_bytes: float = 8) -> ModelStateBytes:
    """What refimpl's own DP / ZeRO strategies keep per rank (fp32 AdamW by default).

    dp, zero1 and zero2 flatten the whole model into one buffer (padded to a multiple of dp:
    `model_state_bytes`); zero3 and fsdp keep one flat buffer per unit, each padded on its own
    (`sharded_state_bytes`).
    """
    unit_sizes = list(unit_sizes)
    kw = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
    if zero_stage == 3:
        return sharded_state_bytes(unit_sizes, dp=dp, zero_stage=3, **kw)
    return model_state_bytes(sum(unit_sizes), dp=dp, zero_stage=zero_stage, **kw)


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes one transformer layer stores for backward (Korthikanti et al. 2022, Table 2).

    16-bit activations, dropout masks included. Without parallelism: s·b·h·(34 + 5·a·s/h); the 5as/h
    part is the softmax output (2 bytes), its dropout mask (1) and the dropout's output (2), each
    a·s²·b values, which grow as s² (the raw scores QKᵀ are not kept).
      tp:                 s·b·h·(10 + 24/t + 5·a·s/(h·t))   (LayerNorm and dropout inputs replicated)
      + sequence_parallel: s·b·h·(34/t + 5·a·s/(h·t))        (those are split along s too)
      recompute="selective": the s² attention part is recomputed, not stored (drops 5as/h)
      recompute="full":   only the layer's input is kept: 2·s·b·h (split by t under SP)
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    linear_part = 34 / t if sequence_parallel else 10 + 24 / t
    attention_part = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    return sbh * (linear_part + attention_part)


def block_activation_bytes(seq: int, batch: int, hidden: int, heads: int, *, mlp_ratio: int = 4,
                           dtype_bytes: int = 4) -> int:
    """Exactly what autograd saves for one block of refimpl.model.GPT (no dropout, explicit attention).

    Korthikanti's 34·s·b·h at 16 bits is 16 saved tensors of size s·b·h (2 bytes each: 32) plus two
    1-byte dropout masks (2). Our block saves the same 16 -- LN1 input and output, Q, K, V, the
    attention output, LN2 input and output, the MLP's up-projection (4·sbh) and GELU output (4·sbh)
    -- but has no dropout. Of the 5·a·s²·b attention bytes it keeps only the softmax output (a·s²·b
    values; the masked scores are not needed by softmax's backward) plus the s×s causal mask
    (bool), and each LayerNorm keeps its mean and 1/std (2·s·b fp32 values).
    """
    assert mlp_ratio == 4, "the 16-tensor count assumes the 4h MLP"
    sbh, sb = seq * batch * hidden, seq * batch
    return (16 * sbh * dtype_bytes            # the s·b·h-sized tensors
            + heads * seq * seq * batch * dtype_bytes   # softmax probabilities
            + seq * seq                       # causal mask, 1 byte per entry
            + 2 * 2 * sb * max(4, dtype_bytes))   # LayerNorm mean and rstd (fp32, or the
                                                      # model's float64), two norms


def tp_block_activation_bytes(seq: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, mlp_ratio: int = 4,
                               dtype_bytes: int = 4) -> float:
    """What autograd saves for one block of refimpl.model.GPT on one of `tp` tensor-parallel ranks
    (refimpl.parallel.tp.layers); tp=1 is `block_activation_bytes`.

    Of the 16 s·b·h-sized tensors, the 12 inside the column/row pairs (Q, K, V, attention output,
    the MLP's 4h up-projection and GELU output) are split by t; the 4 around the LayerNorms (LN1 and
    LN2 inputs and outputs) are replicated, and so are the LayerNorm statistics. The softmax output
    is split by heads: a/t·s²·b values. Korthikanti's Table 2 has the same 24/t split part at 16
    bits; its replicated 10·s·b·h is our 4 tensors (8) plus two 1-byte dropout masks we do not have.

    With sequence parallelism the LayerNorm inputs and statistics hold s/t tokens, but the
    all-gathered LN outputs stay whole: the column-parallel layers save the gathered input they
    multiplied. Megatron instead saves only its s/t slice and all-gathers it again in backward
    (Korthikanti §4.2.2), which is how the paper reaches 34/t; we keep the simpler version and pay
    2 full s·b·h tensors per block for it (one all-gather per column layer fewer in backward).
    """
    assert mlp_ratio == 4, "the 16-tensor count assumes the 4h MLP"
    sbh, sb, t = seq * batch * hidden, seq * batch, tp
    if sequence_parallel:
        full, split, stats = 2 * sbh, 14 * sbh / t, 2 * 2 * sb * 4 / t
    else:
        full, split, stats = 4 * sbh, 12 * sbh / t, 2 * 2 * sb * 4
    return ((full + split) * dtype_bytes + heads * seq * seq * batch * dtype_bytes / t
            + seq * seq + stats)


def llama_block_activation_bytes(seq: int, batch: int, hidden: int, heads: int, ffn: int, *,
                                 tp: int = 1, sequence_parallel: bool = False,
                                 dtype_bytes: int = 4) -> float:
    """What autograd saves for one --arch llama block (refimpl.model.parts: RMSNorm, grouped-query
    attention with rotary positions, SwiGLU of width `ffn`) on one of `tp` ranks, counted tensor
    by tensor from the block's forward (tests/test_memory.py checks the count against the
    activation tracker):

        per RMSNorm   its input x, x / rms(x), its output (the next matmuls' input): 3 s·b·h, and
                      1/rms(x): s·b values at least fp32
        attention     the rotated Q and K (K widened to every query head), the widened V, the
                      attention output (W_O's input): 4 s·b·h, split by t; the softmax output
                      a·s²·b, split by t; the s×s bool causal mask; cos and sin (s·head_dim each)
        SwiGLU        X·W_gate, SiLU of it, X·W_up and their product: 4 s·b·w, split by t

    Grouped-query attention saves no less than multi-head attention here: K and V are widened
    to the query heads before the scores, and the widened copies are what the matmuls keep.
    Under sequence parallelism the RMSNorm inputs, normalised values and statistics hold s/t
    tokens, and each norm's output is saved whole, all-gathered, by the column-parallel layers it
    feeds (as in tp_block_activation_bytes)."""
    sbh, sb, t = seq * batch * hidden, seq * batch, tp
    stat_bytes = max(dtype_bytes, 4)
    if sequence_parallel:
        norms = (2 * 2 * sbh / t + 2 * sbh) * dtype_bytes + 2 * sb / t * stat_bytes
    else:
        norms = 2 * 3 * sbh * dtype_bytes + 2 * sb * stat_bytes
    split = (4 * sbh + 4 * sb * ffn) / t * dtype_bytes + heads * seq * seq * batch * dtype_bytes / t
    rotary = 2 * seq * (hidden // heads) * dtype_bytes
    return norms + split + seq * seq + rotary


def training_flops(n_params: int, tokens: int, *, n_layers: int = 0, seq: int = 0,
                   hidden: int = 0) -> float:
    """FLOPs to train on `tokens` tokens: 6·N·D (2 forward + 4 backward per parameter per token;
    Kaplan et al. 2020, §2.1) plus the attention score and value matmuls, 12·L·h·s per token
    (Chowdhery et al. 2022, PaLM, Appendix B), which 6ND leaves out and which grows with s."""
    attention = 12 * n_layers * seq * hidden * tokens
    return 6 * n_params * tokens + attention


def training_days(flops: float, flops_per_second: float, n_devices: int = 1,
                  utilization: float = 1.0) -> float:
    """Wall-clock days at a given per-device rate and model-FLOPs utilisation."""
    return flops / (flops_per_second * n_devices * utilization) / 86400
