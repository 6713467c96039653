"""Memory of training: the arithmetic the papers and the seed predict (arithmetic.py); the same
quantities counted on a live run are the lab's (refimpl.lab.instrument.model_state)."""
from refimpl.memory.arithmetic import (  # noqa: F401
    GB,
    GiB,
    ModelStateBytes,
    activation_bytes_per_layer,
    block_activation_bytes,
    model_state_bytes,
    shard_numel,
    sharded_state_bytes,
    tp_block_activation_bytes,
    training_flops,
    zero_state_bytes,
)
