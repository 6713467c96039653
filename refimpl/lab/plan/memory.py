"""One layout -> the bytes one GPU holds: model states, stored activations, a backward's transient.

Model states are ZeRO's formulas (refimpl.memory.model_state_bytes) on the parameters of the
first pipeline stage, the one that holds the embedding; activations are Korthikanti et al. 2022's
per-layer bytes (Megatron's block) or refimpl's own block's ("refimpl", what the dry run
measures), times the micro-batches 1F1B keeps in flight. refimpl.lab.plan.predict adds the step time.
"""
from __future__ import annotations

import refimpl.lab.plan.moe as moe  # what a mixture of experts adds
from refimpl.lab.plan.layout import Layout
from refimpl.lab.predict.cp_comm import ring_block_delta_bytes
from refimpl.lab.predict.presets import ModelShape
from refimpl.memory import activation_bytes_per_layer, model_state_bytes, tp_block_activation_bytes

PRECISIONS = {
    # mixed-precision Adam (the ZeRO paper's K = 12), 16-bit activations: what GPU trainings use.
    # bf16 accumulates and reduces the gradients in fp32 (Megatron-LM turns
    # accumulate_allreduce_grads_in_fp32 on for bf16; NeMo's bf16-mixed sets grad_reduce_in_fp32;
    # torchtitan reduces in fp32 by default): 18 bytes per parameter, Megatron's distributed
    # optimizer table's "bf16 param, fp32 grads" row. fp16 with loss scaling (the 2021 runs)
    # keeps 16-bit gradients: the ZeRO paper's 16 bytes.
    "bf16": {"param": 2, "grad": 4, "optimizer": 12, "activation": 2},
    "fp16": {"param": 2, "grad": 2, "optimizer": 12, "activation": 2},
    # the CPU loop's default: fp32 weights and grads, AdamW's m and v
    "fp32": {"param": 4, "grad": 4, "optimizer": 8, "activation": 4},
}


def llama_block_activation_bytes(seq: int, batch: int, hidden: int, heads: int, ffn: int, *,
                                 tp: int = 1, sequence_parallel: bool = False,
                                 dtype_bytes: int = 4) -> float:
    """What autograd saves for one --arch llama block (SwiGLU of width `ffn`) on one of `tp` ranks,
    counted tensor by tensor from its forward."""
    sbh, sb, t = seq * batch * hidden, seq * batch, tp
    stat_bytes = max(dtype_bytes, 4)
    if sequence_parallel:
        norms = (2 * 2 * sbh / t + 2 * sbh) * dtype_bytes + 2 * sb / t * stat_bytes
    else:
        norms = 2 * 3 * sbh * dtype_bytes + 2 * sb * stat_bytes
    split = (4 * sbh + 4 * sb * ffn) / t * dtype_bytes + heads * seq * seq * batch * dtype_bytes / t
    rotary = 2 * seq * (hidden // heads) * dtype_bytes
    return norms + split + seq * seq + rotary


def stage_params(shape: ModelShape, lay: Layout) -> float:
    """Parameters one GPU of the first stage holds: its blocks and the word embedding, split tp
    ways (Megatron's vocabulary-parallel embedding); position embeddings replicated. An untied
    output layer (Llama's; refimpl's GPT by default) is another V x h, on the last stage: on this
    one too when pp = 1 (the dry run found it missing: 2 % of a 7B model's states)."""
    blocks = shape.n_layers // lay.pp * shape.layer_params
    head = 0 if shape.tied_embeddings or lay.pp > 1 else shape.vocab_size * shape.d_model
    positions = 0 if shape.block == "llama" else shape.seq_len * shape.d_model   # rotary: no table
    return (blocks + shape.vocab_size * shape.d_model + head) / lay.tp + positions


def layer_activation_bytes(shape, lay, batch, act_bytes, recompute, activations="korthikanti") -> float:
    """One block's stored activations on one GPU, `batch` sequences of this rank's s/cp tokens."""
    dense = dense_layer_activation_bytes(shape, lay, batch, act_bytes, recompute, activations)
    if shape.n_experts and recompute != "full":   # the experts' MLP instead of the 4h one
        return dense + moe.mlp_activation_delta(shape, lay, batch, act_bytes)
    return dense


def dense_layer_activation_bytes(shape, lay, batch, act_bytes, recompute, activations) -> float:
    """Korthikanti et al. 2022 Table 2 on this rank's s/cp tokens. Ring attention (cp > 1) never
    stores the s x s probabilities (it recomputes them blockwise, refimpl/parallel/cp/ring.py), so its
    score term is dropped as selective recomputation drops it.

    activations="refimpl": refimpl's own block instead (no dropout, the softmax output and the
    causal mask kept: refimpl.memory.tp_block_activation_bytes), what the dry run measures."""
    if activations == "refimpl" and recompute != "selective":
        s, b = shape.seq_len // lay.cp, batch
        if recompute == "full":   # the checkpointed block keeps its input (s/t of it under SP)
            return s * b * shape.d_model * act_bytes / (lay.tp if lay.sequence_parallel else 1)
        if shape.block == "llama" and not shape.n_experts:   # Llama's own block, dense
            block = llama_block_activation_bytes(s, b, shape.d_model, shape.n_heads,
                                                 shape.mlp_width, tp=lay.tp,
                                                 sequence_parallel=lay.sequence_parallel,
                                                 dtype_bytes=act_bytes)
        else:
            block = tp_block_activation_bytes(s, b, shape.d_model, shape.n_heads, tp=lay.tp,
                                              sequence_parallel=lay.sequence_parallel,
                                              dtype_bytes=act_bytes)
        if lay.cp > 1:   # ring attention saves its output once more and a log-sum-exp per
            # query, not the probabilities nor the mask: the bytes refimpl.lab.predict.cp_comm counts
            # for one cp rank, on this tp rank's share of the heads
            block += ring_block_delta_bytes(s, b, shape.d_model / lay.tp, shape.n_heads / lay.tp,
                                            dtype_bytes=act_bytes)
        return block
    if lay.cp > 1 and recompute == "none":
        recompute = "selective"
    sixteen_bit = activation_bytes_per_layer(shape.seq_len // lay.cp, batch, shape.d_model,
                                             shape.n_heads, tp=lay.tp,
                                             sequence_parallel=lay.sequence_parallel,
                                             recompute=recompute)
    return sixteen_bit * act_bytes / 2


def predict_memory(shape: ModelShape, lay: Layout, global_batch: int, precision: str = "bf16",
                   activations: str = "korthikanti") -> dict:
    bytes_ = PRECISIONS[precision]
    m = global_batch // (lay.dp * lay.micro_batch_size)
    if shape.n_experts:   # dense parameters over dp x cp, experts over edp
        states = moe.moe_state_bytes(shape, lay, bytes_)
    else:
        states = model_state_bytes(stage_params(shape, lay), dp=lay.dp * lay.cp,
                                   zero_stage=lay.zero_stage, param_bytes=bytes_["param"],
                                   grad_bytes=bytes_["grad"], optimizer_bytes=bytes_["optimizer"],
                                   padded=False).to_dict()
    b, layers = lay.micro_batch_size, shape.n_layers // lay.pp
    per_layer = layer_activation_bytes(shape, lay, b, bytes_["activation"], lay.recompute,
                                        activations)
    working = 0.0
    if lay.recompute == "full":   # one block's activations, rebuilt while its backward runs
        working = layer_activation_bytes(shape, lay, b, bytes_["activation"], "none", activations)
    # 1F1B: the first stage has min(p, m) micro-batches in flight before its first backward.
    first = per_layer * layers * (min(lay.pp, m) if lay.pp > 1 else 1) + working
    # The last stage (the only one when pp = 1) keeps fp32 logits for the loss: 4·s·b·V/t bytes
    # (Korthikanti et al. 2022, §4.1).
    logits = 4 * (shape.seq_len // lay.cp) * b * shape.vocab_size / lay.tp
    last = per_layer * layers + working + logits
    stored = first + logits if lay.pp == 1 else max(first, last)
    # What a backward holds beyond the stored activations, at its worst moment (refimpl's block,
    # seen in the dry run): the explicit attention's softmax backward has the gradients of the
    # probabilities and of the scores alive together, a/t·s²·b each (ring attention works on
    # blocks instead), and the last stage the logits' gradient, as large as the logits.
    transient = 0.0
    if activations == "refimpl":
        s = shape.seq_len
        attention = 0.0 if lay.cp > 1 else 2 * shape.n_heads / lay.tp * s * s * b * bytes_["activation"]
        transient = max(first + attention, last + attention + logits) - stored if lay.pp > 1 \
            else attention + logits
        if lay.zero_stage == 3:   # ZeRO-3 / FSDP's working units (ZeRO §5.3), as the dry run saw
            # them: the block in backward and the next, prefetched, gathered, and the block's
            # whole gradient before its reduce-scatter
            transient += moe.unit_params(shape, lay) * (2 * bytes_["param"] + bytes_["grad"])
    return {"params_bytes": states["params"], "grads_bytes": states["grads"],
            "optimizer_bytes": states["optimizer"], "activation_bytes": stored,
            "transient_bytes": transient, "memory_bytes": states["total"] + stored + transient}
