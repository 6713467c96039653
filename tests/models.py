"""The model the equivalence tests train: the smallest GPT that still shows every fact they check.

218,240 parameters (4 blocks, so 4 pipeline stages; 4 heads, vocabulary 128 and MLP width 256, so
tp = 2 and 4 divide them; a count that is a multiple of 4 but not of 3, so 3 ranks pad their flat
shards and 4 do not), 1.7 MB in float64. The default GPTConfig is 6.5x larger, which on 2 cores
costs minutes of suite time and shows nothing more.
"""
from refimpl.model import GPTConfig

SMALL = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=4)
