"""Model shapes by name (the planner's presets, the dry run's models), and the published runs they come from."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    # Megatron's GPTs share the word embedding with the output layer; Llama's do not (nor does
    # refimpl's GPT by default): one more V x h matrix.
    tied_embeddings: bool = True
    # mixture of experts (0: a dense model, the fields below unused)
    n_experts: int = 0
    top_k: int = 2
    ffn_hidden: int = 0              # one expert's MLP width; 0: 4h
    capacity_factor: float = 1.0     # expert slots per routed token (1.0: dropless on average)
    kv_heads: int = 0                # grouped-query attention's K/V heads; 0: n_heads
    block: str = "gpt"               # "gpt" (refimpl's) or "llama" (Mixtral's); see the docstring

    @property
    def n_params(self) -> float:
        if self.n_experts:
            return self.dense_params + self.expert_params
        if self.block == "llama":   # counted exactly: attention, norms, and the SwiGLU MLP
            return self.dense_params + self.n_layers * self.one_expert_params
        l, h, v, s = self.n_layers, self.d_model, self.vocab_size, self.seq_len
        head = 0 if self.tied_embeddings else v * h
        return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h)) + head

    # --- a mixture of experts, parameter by parameter ---------------------------------------------
    @property
    def mlp_width(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def one_expert_params(self) -> int:
        """One expert's MLP: refimpl's up (h x w + w) and down (w x h + h); Mixtral's SwiGLU three
        h x w matrices without biases (Shazeer 2020)."""
        h, w = self.d_model, self.mlp_width
        return 3 * h * w if self.block == "llama" else 2 * h * w + w + h

    @property
    def layer_dense_params(self) -> int:
        """One MoE block without its experts: attention, the two norms, the router (E x h, no bias).
        refimpl's attention has biases on q, v and o, none on k (refimpl.model.layers)."""
        h = self.d_model
        kv = (self.kv_heads or self.n_heads) * (h // self.n_heads)   # K and V widths
        if self.block == "llama":
            return 2 * h * h + 2 * h * kv + 2 * h + self.n_experts * h
        attention = (h * h + h) + h * kv + (h * kv + kv) + (h * h + h)
        return attention + 2 * 2 * h + self.n_experts * h

    @property
    def dense_params(self) -> int:
        """Every parameter outside the experts: embeddings (refimpl's learned positions too), the
        blocks' dense parts, the final norm and an untied output layer."""
        h, v = self.d_model, self.vocab_size
        llama = self.block == "llama"
        embed = v * h + (0 if llama else self.seq_len * h)
        head = 0 if self.tied_embeddings else v * h
        return embed + self.n_layers * self.layer_dense_params + (h if llama else 2 * h) + head

    @property
    def expert_params(self) -> int:
        return self.n_layers * self.n_experts * self.one_expert_params

    @property
    def active_params(self) -> int:
        """What one token's forward touches: the dense parameters and top_k experts per block."""
        if not self.n_experts:
            return self.n_params
        return self.dense_params + self.n_layers * self.top_k * self.one_expert_params

    @property
    def layer_params(self) -> float:
        """One block: 12h² weights + 13h biases and LayerNorm parameters; a dense Llama block:
        Q, O (h² each), K, V (h x kv width each), SwiGLU's three h x w, two RMSNorm gains."""
        if self.block == "llama" and not self.n_experts:
            return self.layer_dense_params + self.one_expert_params
        return 12 * self.d_model ** 2 + 13 * self.d_model

    def to_dict(self) -> dict:
        return asdict(self)


# name -> (shape, the global batch in sequences that goes with it)
MODELS = {
    # The seed's 70B example (Llama 2 70B: 80 layers, d_model 8192, 64 heads, 32k vocabulary,
    # 4k context, 4M-token batches = 1024 sequences; Touvron et al. 2023, Table 1). In this shape's
    # 4h-MLP, multi-head form it has ~65B parameters (Llama's SwiGLU MLP and grouped-query
    # attention bring it to 70B): the arithmetic is the same to within that difference.
    "70b": (ModelShape(80, 8192, 64, 32000, 4096, tied_embeddings=False), 1024),
    # Llama 2 7B in the same form (Touvron et al. 2023: 32 layers, d_model 4096, 32 heads, 4k
    # context, the same 4M-token batches).
    "7b": (ModelShape(32, 4096, 32, 32000, 4096, tied_embeddings=False), 1024),
    # The Llama family as released (each model's config.json on the Hugging Face Hub; Touvron et
    # al. 2023 "Llama 2", Table 1 and §2.2; Llama Team 2024 "The Llama 3 Herd of Models",
    # Table 3): RMSNorm, SwiGLU of width ffn_hidden, grouped-query attention with kv_heads, rotary
    # positions, untied output layer. Their parameter counts equal transformers' for the same
    # configs (tests/test_llama_hf.py): 6.74B, 69.0B, 8.03B, 70.6B. Batches: Llama 2's 4M tokens;
    # Llama 3's 8B and 70B, like the 405B below, are taken at 16M tokens = 2048 sequences of 8192.
    "llama2-7b": (ModelShape(32, 4096, 32, 32000, 4096, tied_embeddings=False, ffn_hidden=11008,
                             block="llama"), 1024),
    "llama2-70b": (ModelShape(80, 8192, 64, 32000, 4096, tied_embeddings=False, ffn_hidden=28672,
                              kv_heads=8, block="llama"), 1024),
    "llama3-8b": (ModelShape(32, 4096, 32, 128256, 8192, tied_embeddings=False, ffn_hidden=14336,
                             kv_heads=8, block="llama"), 2048),
    "llama3-70b": (ModelShape(80, 8192, 64, 128256, 8192, tied_embeddings=False,
                              ffn_hidden=28672, kv_heads=8, block="llama"), 2048),
    # GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, 2048 context,
    # 3.2M-token batches = 1536 sequences; Megatron's 51200-entry vocabulary.
    "gpt3-175b": (ModelShape(96, 12288, 96, 51200, 2048), 1536),
    # BLOOM 176B (BigScience, Le Scao et al. 2022, "BLOOM: A 176B-Parameter Open-Access
    # Multilingual Language Model", Table 3; the training script, bigscience-workshop/bigscience
    # train/tr11-176B-ml/tr11-176B-ml.slurm): 70 layers, d_model 14336, 112 heads, 2048 context,
    # a 4h GELU MLP and the word embedding tied to the output layer, as this shape has; its
    # 250680 tokens padded to a 250880-entry vocabulary (--pad-vocab-size-to, for tp); batches of
    # 2048 sequences. Two things this shape cannot say, neither large enough to move a layout:
    # ALiBi (Press et al. 2022) instead of learned positions (the shape counts 2048 x 14336 = 29M
    # position parameters BLOOM has not, 0.02 %; ALiBi's biases are a·s numbers added to scores
    # the shape already counts) and a LayerNorm after the word embedding (2h parameters). On its
    # own 384 GPUs (3 x 128) no layout divides 70 layers and 112 heads: BLOOM's pipeline counted
    # its embeddings as layers, and refimpl.lab.plan.published compares its run that way.
    "bloom-176b": (ModelShape(70, 14336, 112, 250880, 2048), 2048),
    # Llama 3 405B (Llama Team 2024, "The Llama 3 Herd of Models", Table 3; the released
    # config.json): 126 layers, d_model 16384, 128 query heads and 8 key/value heads (grouped-
    # query attention), a SwiGLU MLP of width 53248, an untied output layer, a 128256-entry
    # vocabulary (Table 3 says 128K: 128000 tokens and 256 reserved), 8192 context in pre-training,
    # 16M-token batches = 2048 sequences (§3.4.1, the last step of its 4M, 8M, 16M ramp). Its
    # parameter count equals transformers' for the same config (tests/test_llama_hf.py): 405.9B.
    # pp = 16 does not divide 126 layers: Llama 3's pipeline left one block's place to the
    # embedding and one to the output layer, and refimpl.lab.plan.published compares its run as
    # those 128 slots.
    "llama3-405b": (ModelShape(126, 16384, 128, 128256, 8192, tied_embeddings=False,
                               ffn_hidden=53248, kv_heads=8, block="llama"), 2048),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1; the released config.json):
    # 32 layers, d_model 4096, 32 query heads and 8 key/value heads, 8 SwiGLU experts of width
    # 14336, top-2, vocabulary 32000, untied output layer; 46.7B parameters, 12.9B active. Context
    # 4096 and 4M-token batches (1024 sequences) as for Llama 2: the paper gives no batch.
    "mixtral-8x7b": (ModelShape(32, 4096, 32, 32000, 4096, tied_embeddings=False, n_experts=8,
                                top_k=2, ffn_hidden=14336, kv_heads=8, block="llama"), 1024),
    # Mixtral 8x22B (Mistral AI's model card and config.json, 2024): 56 layers, d_model 6144, 48
    # query and 8 key/value heads, 8 experts of width 16384, top-2, vocabulary 32768; 141B
    # parameters, 39B active. Same context and batch assumptions as above.
    "mixtral-8x22b": (ModelShape(56, 6144, 48, 32768, 4096, tied_embeddings=False, n_experts=8,
                                 top_k=2, ffn_hidden=16384, kv_heads=8, block="llama"), 1024),
    # A DeepSeek-V3-like model in refimpl's own block (LayerNorm, biases, GELU experts):
    # DeepSeek-V3's width and expert shape (Liu et al. 2024, tech report §4.2: d_model
    # 7168, 128 heads, 256 routed experts of width 2048, top-8, vocabulary 129280) on 16 layers
    # instead of 61, without its shared expert, multi-head latent attention and first three dense
    # blocks, which this shape cannot say, and with its 2-matrix GELU experts: 125B parameters,
    # 9.0B active (DeepSeek-V3: 671B, 37B). refimpl's GPTConfig cannot build it (its mlp_ratio is an
    # integer; 2048 / 7168 is not), so neither the loop nor the dry run can run it.
    "deepseek-v3-16l": (ModelShape(16, 7168, 128, 129280, 4096, tied_embeddings=False,
                                   n_experts=256, top_k=8, ffn_hidden=2048), 1024),
}


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", Table 1 (weak scaling on Selene: DGX A100 80GB nodes, 8 GPUs each, 8 HDR IB NICs).
# Every model: vocabulary 51200, sequence 2048, activation recomputation, interleaved 1F1B schedule
# with the scatter/gather optimisation, mixed-precision Adam, no ZeRO. achieved_tflops is their
# per-GPU rate counted with their formula F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per
# iteration (recomputation included), which `megatron_flops` reproduces.
MEGATRON_2021 = [
    # params_b, heads, hidden, layers, tp, pp, gpus, batch, achieved TFLOP/s per GPU
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
MEGATRON_VOCAB, MEGATRON_SEQ = 51200, 2048


def megatron_runs() -> list[dict]:
    """Table 1 as dicts, each with its ModelShape."""
    keys = ("params_b", "n_heads", "d_model", "n_layers", "tp", "pp", "gpus", "global_batch",
            "achieved_tflops")
    runs = []
    for row in MEGATRON_2021:
        r = dict(zip(keys, row))
        r["shape"] = ModelShape(r["n_layers"], r["d_model"], r["n_heads"], MEGATRON_VOCAB,
                                MEGATRON_SEQ)
        r["dp"] = r["gpus"] // (r["tp"] * r["pp"])
        runs.append(r)
    return runs


for _r in megatron_runs():   # each Table 1 shape is also a preset: megatron-1.7b ... megatron-1008b
    MODELS[f"megatron-{_r['params_b']:g}b"] = (_r["shape"], _r["global_batch"])
MODELS["megatron-1t"] = MODELS["megatron-1008b"]


def megatron_flops(shape: ModelShape, global_batch: int) -> float:
    """FLOPs of one iteration as Narayanan et al. 2021 count them (§5.1): forward, backward and the
    recomputed forward of every GEMM, plus the logit layer's forward and backward."""
    b, s, l, h, v = global_batch, shape.seq_len, shape.n_layers, shape.d_model, shape.vocab_size
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def get_model(name: str) -> tuple[ModelShape, int]:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(MODELS)}") from None


# Narayanan et al. 2021, §5.1 (end-to-end training time, their eq. 4: 8·T·P / (n·X)): GPT-3 175B on
# 1024 A100s, batch 1536, 300B tokens, at X = 140 teraFLOP/s per GPU, takes about 34 days; the
# layout cited for it is t = 8, p = 8 (dp = 16).
GPT3_ON_1024 = {"model": "gpt3-175b", "gpus": 1024, "global_batch": 1536, "tokens": 300e9,
                "tp": 8, "pp": 8, "tflops": 140, "days": 34}


def training_days_of(step_time_s: float, global_batch: int, seq_len: int, tokens: float) -> float:
    """Days to see `tokens` tokens at one step of global_batch sequences per step_time_s."""
    return tokens / (global_batch * seq_len) * step_time_s / 86400
