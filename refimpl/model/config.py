"""The reference model's shape: `GPTConfig` (dense, or a mixture of experts when n_experts > 0)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


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
    capacity_scope: str = "batch"   # capacity and aux f_i per forward ("batch") or per "sequence"

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
