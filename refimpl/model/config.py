"""The reference model's shape: `GPTConfig`, GPT-2's block or Llama's (`arch`, refimpl.model.parts),
dense or a mixture of experts (n_experts > 0; with arch="llama", Mixtral's block)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

ARCHS = ("gpt", "llama")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 64          # the maximum; a batch may be shorter
    d_model: int = 160         # 8 heads divide by tp = 2, 4, 8; not by 3: flat shards get padded
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
    # the architecture (refimpl.model.parts); the fields below it are Llama's only
    arch: str = "gpt"
    n_kv_heads: int = 0             # grouped-query attention's key/value heads; 0: n_heads
    ffn_hidden: int = 0             # SwiGLU's width w; 0: 2/3 of mlp_ratio·h, rounded up to 32
    rope_theta: float = 10000.0     # rotary base (Llama 2: 1e4; Llama 3: 5e5; Mixtral: 1e6)
    norm_eps: float = 1e-5          # RMSNorm's epsilon

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.arch not in ARCHS:
            raise ValueError(f"--arch must be one of {', '.join(ARCHS)} (got {self.arch!r})")
        if self.arch == "gpt" and (self.n_kv_heads or self.ffn_hidden):
            raise ValueError("--kv-heads and --ffn-hidden need --arch llama (GPT-2's block has "
                             "multi-head attention and a mlp_ratio·h MLP)")
        if self.arch == "llama":
            if not 0 <= self.n_kv_heads <= self.n_heads or self.n_heads % self.kv_heads:
                raise ValueError(f"--kv-heads {self.n_kv_heads} must divide n_heads = {self.n_heads} "
                                 "(each key/value head serves a group of query heads)")
            if self.head_dim % 2:
                raise ValueError(f"head_dim = d_model / n_heads = {self.head_dim} must be even: "
                                 "rotary embeddings rotate pairs of channels")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (grouped-query attention); n_heads for multi-head attention."""
        return self.n_kv_heads or self.n_heads

    @property
    def swiglu_hidden(self) -> int:
        """ffn_hidden, or 2/3 of mlp_ratio·h (Shazeer 2020 §2: same parameters as the GELU MLP),
        rounded up to a multiple of 32 (so tp = 2, 4, 8 split it evenly)."""
        return self.ffn_hidden or 32 * -(-2 * self.mlp_ratio * self.d_model // (3 * 32))

    def to_dict(self) -> dict:
        return asdict(self)
