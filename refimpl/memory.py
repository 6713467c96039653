"""Memory and compute arithmetic of training: model states (ZeRO, Rajbhandari et al. 2020),
activations (Korthikanti et al. 2022, and refimpl's blocks tensor by tensor), training FLOPs.
The same quantities counted on a live run are the lab's (refimpl.lab.instrument.model_state)."""
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
    """Bytes of model states one data-parallel rank holds (ZeRO paper §3-5)."""
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
    """model_state_bytes summed over units that are each flattened and padded on their own."""
    parts = [model_state_bytes(n, dp=dp, zero_stage=zero_stage, param_bytes=param_bytes,
                               grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
             for n in unit_sizes]
    return ModelStateBytes(params=sum(p.params for p in parts), grads=sum(p.grads for p in parts),
                           optimizer=sum(p.optimizer for p in parts))


def zero_state_bytes(unit_sizes, *, dp: int, zero_stage: int, param_bytes: float = 4,
                     grad_bytes: float = 4, optimizer_bytes: float = 8) -> ModelStateBytes:
    """What refimpl's own DP / ZeRO strategies keep per rank (fp32 AdamW by default)."""
    unit_sizes = list(unit_sizes)
    kw = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
    if zero_stage == 3:
        return sharded_state_bytes(unit_sizes, dp=dp, zero_stage=3, **kw)
    return model_state_bytes(sum(unit_sizes), dp=dp, zero_stage=zero_stage, **kw)


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes one transformer layer stores for backward (Korthikanti et al., Table 2)."""
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
    """Exactly what autograd saves for one block of refimpl.model.GPT (no dropout, explicit attention)."""
    assert mlp_ratio == 4, "the 16-tensor count assumes the 4h MLP"
    sbh, sb = seq * batch * hidden, seq * batch
    return (16 * sbh * dtype_bytes            # the s·b·h-sized tensors
            + heads * seq * seq * batch * dtype_bytes   # softmax probabilities
            + seq * seq                       # causal mask, 1 byte per entry
            + 2 * 2 * sb * max(4, dtype_bytes))   # two LayerNorms' mean and rstd (at least fp32)


def tp_block_activation_bytes(seq: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, mlp_ratio: int = 4,
                               dtype_bytes: int = 4) -> float:
    """What autograd saves for one block of refimpl.model.GPT on one of `tp` tensor-parallel ranks
    (refimpl.parallel.tp.layers); tp=1 is `block_activation_bytes`."""
    assert mlp_ratio == 4, "the 16-tensor count assumes the 4h MLP"
    sbh, sb, t = seq * batch * hidden, seq * batch, tp
    if sequence_parallel:
        full, split, stats = 2 * sbh, 14 * sbh / t, 2 * 2 * sb * 4 / t
    else:
        full, split, stats = 4 * sbh, 12 * sbh / t, 2 * 2 * sb * 4
    return ((full + split) * dtype_bytes + heads * seq * seq * batch * dtype_bytes / t
            + seq * seq + stats)


def training_flops(n_params: int, tokens: int, *, n_layers: int = 0, seq: int = 0,
                   hidden: int = 0) -> float:
    """6·N·D (Kaplan et al. 2020, §2.1) plus attention's two matmuls, 12·L·h·s per token (PaLM,
    Appendix B)."""
    attention = 12 * n_layers * seq * hidden * tokens
    return 6 * n_params * tokens + attention

