"""Memory and compute arithmetic of training, and the same quantities measured on a live model.

Analytic (what theory predicts):
  model_state_bytes         params + grads + optimizer states per rank, plain DP and ZeRO 1/2/3
  activation_bytes_per_layer  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
                            Transformer Models", Table 2 (16-bit activations)
  training_flops            6·N·D (Kaplan et al. 2020) plus the attention term (PaLM, App. B)

Measured (what a run holds):
  measured_model_state      bytes of parameters, gradients and optimizer-state tensors, by storage
  ActivationTracker         bytes of tensors autograd saves for backward, live and peak
"""
from __future__ import annotations

import math
import weakref
from dataclasses import asdict, dataclass

import torch

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
    implementations allocate (refimpl.parallel.flat_param): a shard is S = ceil(N/dp) elements and
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
            + 2 * 2 * sb * 4)                 # LayerNorm mean and rstd, fp32, two norms


def tp_block_activation_bytes(seq: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, mlp_ratio: int = 4,
                               dtype_bytes: int = 4) -> float:
    """What autograd saves for one block of refimpl.model.GPT on one of `tp` tensor-parallel ranks
    (refimpl.parallel.tp); tp=1 is `block_activation_bytes`.

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


# --- measured --------------------------------------------------------------------------------------

def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views and tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen or t.numel() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    """The tensors an optimizer keeps per parameter (Adam: exp_avg, exp_avg_sq), not scalars like step."""
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                yield value


def measured_model_state(params, optimizer: torch.optim.Optimizer | None) -> ModelStateBytes:
    params = list(params)
    return ModelStateBytes(
        params=tensor_bytes(params),
        grads=tensor_bytes(p.grad for p in params),
        optimizer=tensor_bytes(optimizer_state_tensors(optimizer)) if optimizer else 0,
    )


class ActivationTracker:
    """Counts bytes of the tensors autograd saves for backward, as they are saved and freed.

        with ActivationTracker(exclude=model.parameters()) as act:
            loss = model(x).sum(); loss.backward()
        act.peak   # the most bytes saved at any moment

    A pack hook wraps each saved tensor in a small holder; when autograd frees the graph (after
    backward) the holder is released and its bytes leave the live count. Storages are counted once
    however many ops save them, and parameters (saved by every Linear) are excluded: they are model
    state, not activations. This is CPU-friendly; on GPU torch.cuda.max_memory_allocated tells the
    same story plus allocator slack.
    """

    def __init__(self, exclude=()):
        # Keyed by storage *identity*, not address: ZeRO-3 / FSDP free a gathered parameter buffer
        # (its storage resized to 0) after use and reallocate it, at a new address, before
        # backward; the storage object itself lives for the whole run.
        self._excluded = {_storage_id(p) for p in exclude}
        self._live: dict[int, list] = {}   # storage ptr -> [refcount, nbytes]
        self.current = 0
        self.peak = 0
        self._hooks = None

    def exclude(self, tensors) -> None:
        """Also leave these storages out (e.g. parameters gathered on the fly by ZeRO-3)."""
        self._excluded.update(_storage_id(t) for t in tensors)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, saved: torch.Tensor):
        t = _local(saved)
        key = t.untyped_storage().data_ptr()
        if (_storage_id(t) in self._excluded or isinstance(saved, torch.nn.Parameter)
                or t.numel() == 0):
            return saved
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, t.untyped_storage().nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(saved, self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes this rank holds: a DTensor's local shard, else the tensor itself
    (a DTensor is a wrapper without storage of its own)."""
    return getattr(t, "_local_tensor", t)


def _storage_id(t: torch.Tensor) -> int:
    """The storage object behind a tensor (stable while it lives, even if resized)."""
    return _local(t).untyped_storage()._cdata


class _Saved:
    """A saved tensor plus a finaliser that tells the tracker when autograd let go of it."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor, tracker: ActivationTracker, key: int):
        self.tensor = tensor
        weakref.finalize(self, tracker._release, key)


def measure_block_activations(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Peak bytes saved for backward by one forward of `block` on input `x` (parameters excluded)."""
    x = x.detach().requires_grad_()
    with ActivationTracker(exclude=block.parameters()) as tracker:
        block(x)
    return tracker.peak


def measure_step_activations(model: torch.nn.Module, inputs: torch.Tensor,
                             targets: torch.Tensor) -> int:
    """Peak bytes saved for backward over a whole forward + backward of the model and its loss."""
    from refimpl.model import lm_loss

    with ActivationTracker(exclude=model.parameters()) as tracker:
        lm_loss(model(inputs), targets).backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak
