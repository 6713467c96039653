"""The reference model: a tiny GPT, deterministic from a seed, and a deterministic data stream.

Every strategy in `refimpl.parallel` starts from the same `GPT(config)` built under the same seed,
and trains on the same `synthetic_batch(config, step)`, so "same losses, same weights" is a fair
test. The model is deliberately plain (pre-norm blocks, explicit attention, GELU MLP) so that each
weight matrix is one that a strategy can shard, slice or move by name:

    embed.tok, embed.pos          token and position embeddings
    blocks[i].attn.{q,k,v,o}      W_Q, W_K, W_V (column-parallel in TP), W_O (row-parallel)
    blocks[i].mlp.{up,down}       A (column-parallel) and B (row-parallel) of Y = GELU(XA)B
    final_norm, lm_head           (lm_head shares embed.tok's weight when tie_embeddings)

Attention is written out (scores -> mask -> softmax -> @V) instead of calling a fused kernel: the
s x s score and probability tensors it saves for backward are the O(s^2) activation term that
notebook 00 measures against Korthikanti et al. 2022.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64          # the maximum; a batch may be shorter
    # 160 = 8 heads x 20: heads divide by tp = 2, 4, 8, while 160 (so every parameter count) is
    # not a multiple of 3, so a 3-rank run must pad its flat shards: the uneven case is the default.
    d_model: int = 160
    n_heads: int = 8
    n_layers: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    # MoE: n_experts == 0 keeps the dense MLP; otherwise each block's MLP is a router + experts
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25   # expert capacity = ceil(top_k * tokens / n_experts * factor)
    balance: str = "aux"            # "aux" (Switch loss), "bias" (DeepSeek-V3), "none"
    aux_alpha: float = 0.01         # Switch's alpha
    bias_gamma: float = 0.001       # DeepSeek-V3's bias update speed

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q = nn.Linear(d, d)
        # No bias on K: adding the same vector to every key adds q·b_k to a whole row of scores,
        # which softmax cancels, so its gradient is exactly zero. Adam would then turn fp32
        # round-off in that zero (it differs between 1 and N ranks) into full-size steps.
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(attention(self.q(x), self.k(x), self.v(x), self.n_heads))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Causal multi-head attention on [batch, seq, n_heads*head_dim] inputs.

    `n_heads` is the number of heads *in these tensors*: under tensor parallelism a rank holds
    n_heads/tp heads and calls this unchanged, which is why heads must divide by tp.
    """
    b, s, width = q.shape
    hd = width // n_heads
    q, k, v = (t.view(b, s, n_heads, hd).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    return (probs @ v).transpose(1, 2).reshape(b, s, width)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = make_mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def make_mlp(cfg: GPTConfig) -> nn.Module:
    """The block's feed-forward layer: dense, or a mixture of experts when cfg.n_experts > 0."""
    if cfg.n_experts > 0:
        from refimpl.parallel.moe import MoEMLP  # imported here: moe.py imports this module

        return MoEMLP(cfg)
    return MLP(cfg)


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


def _init_weights(module: nn.Module) -> None:
    # GPT-2's init: N(0, 0.02) for matrices and embeddings, zero biases, unit LayerNorm.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The reference weights: every rank that calls this with the same seed gets the same model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the batch given."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() skips tied duplicates


# --- data -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Batch:
    """One global batch of token ids: `inputs[b, t]` predicts `targets[b, t]` (= inputs shifted)."""
    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def size(self) -> int:
        return self.inputs.shape[0]

    def shard(self, index: int, count: int) -> "Batch":
        """Rows [index*B/count, (index+1)*B/count): this data-parallel rank's view."""
        if self.size % count:
            raise ValueError(f"global batch {self.size} is not divisible by {count}")
        per = self.size // count
        return Batch(self.inputs[index * per:(index + 1) * per],
                     self.targets[index * per:(index + 1) * per])

    def micro_batches(self, count: int) -> list["Batch"]:
        """Split into `count` equal micro-batches (gradient accumulation, pipeline schedules)."""
        return [self.shard(i, count) for i in range(count)]

    def to(self, device) -> "Batch":
        return Batch(self.inputs.to(device), self.targets.to(device))


def synthetic_batch(cfg: GPTConfig, global_batch: int, seq_len: int, seed: int, step: int) -> Batch:
    """A deterministic, learnable global batch for `step`, identical on every rank.

    Each sequence follows a fixed random permutation of the vocabulary (token t -> perm[t]) with 10%
    of tokens replaced by noise, so the loss falls quickly from ln(vocab) and never reaches zero.
    It depends only on (seed, step), never on the world size: that is what lets a 3-rank run be
    compared with the 1-process reference.
    """
    if seq_len > cfg.seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's position table ({cfg.seq_len})")
    perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    tokens = torch.empty(global_batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab_size, (global_batch,), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = perm[tokens[:, t]]
    noise = torch.rand(global_batch, seq_len + 1, generator=g) < 0.1
    tokens[noise] = torch.randint(cfg.vocab_size, (int(noise.sum()),), generator=g)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
