"""The reference model, which no parallelism changes the maths of.

    config.py                 GPTConfig: the shape (dense, or experts when n_experts > 0; arch)
    parts.py                  which norm, attention and MLP a "gpt" or a "llama" block has
    layers.py                 GPT-2's causal self-attention and GELU MLP
    rmsnorm, rotary, gqa,     Llama's RMSNorm, rotary positions, grouped-query attention,
      swiglu                  SwiGLU MLP (Mixtral's experts too)
    hf.py                     Hugging Face checkpoints in and out (Llama, Mixtral)
    moe.py                    the mixture-of-experts MLP: router, top-k, capacity, balancing
    gpt.py                    blocks, the GPT, its deterministic init, the loss
    activation_checkpointing  recompute each block in backward
    data.py                   the deterministic synthetic batches

The model is architecture only: it never imports `refimpl.parallel`. Parallelisms transform it
from the outside (refimpl.compose).
"""
from refimpl.model.config import GPTConfig
from refimpl.model.data import Batch, synthetic_batch
from refimpl.model.gpt import GPT, Block, Embedding, build_model, converted, count_params, lm_loss, make_mlp
from refimpl.model.layers import MLP, CausalSelfAttention, attention

__all__ = ["GPTConfig", "Batch", "synthetic_batch", "GPT", "Block", "Embedding", "build_model",
           "converted", "count_params", "lm_loss", "make_mlp", "MLP", "CausalSelfAttention", "attention"]
