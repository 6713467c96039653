"""The reference model, which no parallelism changes the maths of."""
from refimpl.model.config import GPTConfig
from refimpl.model.data import Batch, synthetic_batch
from refimpl.model.gpt import GPT, Block, Embedding, build_model, converted, count_params, lm_loss
from refimpl.model.layers import MLP, CausalSelfAttention, attention

__all__ = ["GPTConfig", "Batch", "synthetic_batch", "GPT", "Block", "Embedding", "build_model",
           "converted", "count_params", "lm_loss", "MLP", "CausalSelfAttention", "attention"]
