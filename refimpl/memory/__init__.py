"""Memory of training: the arithmetic (what the seed and the papers predict), the same quantities
measured on a live model, and CUDA's allocator view.

    arithmetic.py   model_state_bytes (DP and ZeRO 1/2/3), activation_bytes_per_layer
                    (Korthikanti et al. 2022), training FLOPs and days
    measured.py     bytes of a live model's states and of what autograd saves
    cuda.py         torch.cuda's allocator counters, beside the arithmetic"""
from refimpl.memory.arithmetic import (
    GB,
    GiB,
    ModelStateBytes,
    activation_bytes_per_layer,
    block_activation_bytes,
    llama_block_activation_bytes,
    model_state_bytes,
    shard_numel,
    sharded_state_bytes,
    tp_block_activation_bytes,
    training_days,
    training_flops,
    zero_state_bytes,
)
from refimpl.memory.measured import (
    ActivationTracker,
    measure_block_activations,
    measure_step_activations,
    measured_model_state,
    optimizer_state_tensors,
    per_element,
    tensor_bytes,
)

__all__ = ["GB", "GiB", "ModelStateBytes", "shard_numel", "model_state_bytes", "sharded_state_bytes", "zero_state_bytes", "activation_bytes_per_layer", "block_activation_bytes", "tp_block_activation_bytes", "llama_block_activation_bytes", "training_flops", "training_days", "tensor_bytes", "optimizer_state_tensors", "per_element", "measured_model_state", "ActivationTracker", "measure_block_activations", "measure_step_activations"]
