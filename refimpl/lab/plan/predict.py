"""One layout -> predicted step time, and with refimpl.lab.plan.memory's bytes per GPU, the planner's
row for it. Every term is a formula with its source; the grid and which axes stay inside a node
are refimpl.lab.plan.layout's.

Step time, for the busiest pipeline stage (the first holds the embedding, the last the logits):
  per micro-batch  T_mb = GEMMs / matmul rate             (forward 1x, backward 2x, recompute +1x)
                        + memory-bound ops / HBM rate     (LayerNorm, softmax, GeLU, residuals...)
                        + tp collectives + cp ring hops not hidden by the attention they overlap
                        + pp activation sends
  pipeline         (m + p - 1) · T_mb         1F1B: bubble (p-1)/(m+p-1) (Narayanan et al. 2021 §2.2)
  then             data-parallel gradient sync (exposed) + the optimizer step (memory-bound)
Collective times are the alpha-beta model of a ring (Thakur et al. 2005; the seed's §2.3), written
once in refimpl.cost.alpha_beta.ring_seconds: an all-reduce of M bytes on n ranks costs
2(n-1)·alpha + 2(n-1)/n · M / beta, an all-gather or reduce-scatter half that.
"""
from __future__ import annotations

import refimpl.lab.plan.moe as moe  # what a mixture of experts adds
from refimpl.cost.alpha_beta import ring_seconds
from refimpl.lab.plan.dp_sync import dp_sync_seconds
from refimpl.lab.plan.layout import Layout
from refimpl.lab.plan.memory import PRECISIONS, layer_activation_bytes, predict_memory, stage_params
from refimpl.lab.predict.hardware import MEMORY_HEADROOM, Hardware
from refimpl.lab.predict.presets import ModelShape
from refimpl.memory import training_flops


def micro_batch_work(shape: ModelShape, lay: Layout, act_bytes: int) -> dict:
    """What one micro-batch costs the busiest stage (the last: its blocks and the logits), before
    any communication: GEMM FLOPs, bytes the memory-bound ops move, and block passes (each pass
    pays a fixed cost of op dispatch and kernel launches: Hardware.block_overhead_s)."""
    s, h, v = shape.seq_len, shape.d_model, shape.vocab_size
    b, t, c = lay.micro_batch_size, lay.tp, lay.cp
    layers, s_loc = shape.n_layers // lay.pp, s // c
    # Narayanan et al. 2021, §5.1 counts: 4 GEMMs + QK^T and PV per layer, forward
    layer_fwd = 24 * b * s_loc * h * h * (1 + s / (6 * h)) / t
    if shape.n_experts:   # top_k experts and a router instead of the 4h MLP
        layer_fwd += moe.mlp_flops_delta(shape, lay, b)
    attn_core_fwd = 4 * b * s_loc * s * h / t
    passes = 3 + (1 if lay.recompute == "full" else 0)   # backward = 2 forwards; recompute + 1
    layer_flops = layer_fwd * passes + (attn_core_fwd if lay.recompute == "selective" else 0)
    logits_flops = 3 * 2 * b * s_loc * h * v / t
    # memory-bound ops read and write every activation once per pass (a coarse count): the
    # s·b·h-sized ones (Korthikanti et al. 2022 Table 2 without its s² term) and the softmax and
    # dropout over the attention scores, 5 bytes per score at 16 bits. Ring attention (cp > 1)
    # stores none of the scores but still computes them, block by block: the diagonal block and
    # half of each of the c - 1 blocks that hop in (head-tail chunks skip the masked halves),
    # s/c · s/c · (c + 1)/2 scores per head, against s² for one rank's unmasked attention.
    scores = shape.n_heads / t * b * (s * s if c == 1 else s_loc * s_loc * (c + 1) / 2)
    per_layer = (layer_activation_bytes(shape, lay, b, act_bytes, "selective")
                 + 5 * scores * act_bytes / 2)
    hbm = 2 * passes * layers * per_layer
    return {"flops": layers * layer_flops + logits_flops, "hbm_bytes": hbm,
            "block_passes": (layers + 1) * passes,   # + 1: embedding and logits
            "layer_flops": layer_flops, "logits_flops": logits_flops}


def predict_time(shape: ModelShape, lay: Layout, global_batch: int, hw: Hardware,
                 gpus_per_node: int = 8, precision: str = "bf16",
                 grad_messages: int = 1, zero2_per_micro_batch: bool = True) -> dict:
    """Step time of one layout. Every collective pays alpha per ring step and its bytes over
    beta, so where alpha is large (CPU ranks: ~1 ms) the number of messages matters as much as
    their size. `grad_messages` is how many collectives the data-parallel gradient sync is cut
    into: 1 models a bucketed sync (DDP's buckets overlap the backward on a GPU, leaving about one
    exposed); refimpl's dp-naive sends one per parameter tensor, its zero1/zero2 one reduce per
    owner (refimpl.lab.plan.cpu.grad_messages)."""
    bytes_ = PRECISIONS[precision]
    act = bytes_["activation"]
    s, h = shape.seq_len, shape.d_model
    b, t, c, p = lay.micro_batch_size, lay.tp, lay.cp, lay.pp
    m = global_batch // (lay.dp * b)
    layers, s_loc = shape.n_layers // p, s // c

    work = micro_batch_work(shape, lay, act)
    compute_s = (work["flops"] / hw.matmul_rate + work["hbm_bytes"] / hw.memory_bandwidth
                 + work["block_passes"] * hw.block_overhead_s)
    hidden_by = compute_s if hw.overlaps_comm else 0.0   # what overlapping comm can hide behind

    # --- tensor parallel: 2 all-reduces forward, 2 backward, 2 more if the forward is redone
    # (Shoeybi et al. 2019 §3, f and g); sequence parallel swaps each for a reduce-scatter +
    # all-gather pair: the same bytes and ring steps (Korthikanti et al. 2022 §4.2.2). The ends of
    # the model add their own: the vocabulary-parallel embedding's output (forward) and the
    # logits' input gradient (backward), b*s*h each, and cross-entropy's max, sum of exponentials
    # and target logit, b*s values each (Megatron's vocab_parallel_cross_entropy). The busiest
    # stage is the last; with pp = 1 it also holds the embedding.
    tp_alpha, tp_beta = hw.link(lay.within_node("tp", gpus_per_node))
    n_tp = 4 + (2 if lay.recompute == "full" else 0)
    activation_ar = ring_seconds("all_reduce", b * s_loc * h * act, t, tp_alpha, tp_beta)
    ends = ((2 if p == 1 else 1) * activation_ar
            + 3 * ring_seconds("all_reduce", b * s_loc * 4, t, tp_alpha, tp_beta))
    tp_s = layers * n_tp * activation_ar + ends

    # --- context parallel (refimpl/parallel/cp/ring.py; Liu et al. 2023, Ring Attention, §3):
    # forward, K and V hop c - 1 times, each hop hidden behind the attention on the block in
    # hand; with head-tail chunks a rank computes half of each arriving block, (s/c)²/2 query-key
    # pairs at 4 FLOPs per pair and channel (QKᵀ and PV), so a hop hides only where
    # s/c >= 2 · rate / bandwidth (Liu et al.'s c >= F/B, halved by the causal mask). Backward,
    # every step sends the accumulated dK, dV on as well (c steps; c - 1 also move K, V), against
    # twice the forward's work per block.
    cp_s = 0.0
    if c > 1:
        cp_alpha, cp_beta = hw.link(lay.within_node("cp", gpus_per_node))
        hop = cp_alpha + 2 * b * s_loc * h / t * act / cp_beta
        block = 4 * b * s_loc * s_loc / 2 * h / t / hw.matmul_rate
        block = block if hw.overlaps_comm else 0.0
        fwd_rings = 1 + (1 if lay.recompute == "full" else 0)
        backward = (c - 1) * max(0.0, 2 * hop - 2 * block) + max(0.0, hop - 2 * block)
        cp_s = layers * ((c - 1) * fwd_rings * max(0.0, hop - block) + backward)

    # --- pipeline: one activation send forward and one gradient send backward per micro-batch,
    # 1/t of it per GPU (scatter/gather, Narayanan et al. 2021 §4.1)
    pp_s = 0.0
    if p > 1:
        pp_alpha, pp_beta = hw.link(lay.within_node("pp", gpus_per_node))
        pp_s = 2 * (pp_alpha + b * s_loc * h / t * act / pp_beta)

    # --- expert parallelism: the dispatch and combine all-to-alls (refimpl.lab.plan.moe)
    ep_s = moe.ep_comm_seconds(shape, lay, hw, gpus_per_node, act) if shape.n_experts else 0.0

    per_micro_batch = compute_s + tp_s + cp_s + pp_s + ep_s
    bubble = (p - 1) / (m + p - 1)
    pipeline_s = (m + p - 1) * per_micro_batch

    # --- data parallel over dp x cp (both hold the same weights): exposed after the last backward
    n_dp = lay.dp * c
    dp_within = lay.within_node("dp", gpus_per_node) if lay.dp > 1 else lay.within_node("cp", gpus_per_node)
    dp_alpha, dp_beta = hw.link(dp_within)
    params = moe.dense_stage_params(shape, lay) if shape.n_experts else stage_params(shape, lay)
    backward = (compute_s * 2 / (3 + (1 if lay.recompute == "full" else 0))
                * (1 if hw.overlaps_comm else 0))   # 2 of a micro-batch's 3 (or 4) passes
    dp_s = dp_sync_seconds(lay.zero_stage, param_count=params, param_bytes=bytes_["param"],
                           grad_bytes=bytes_["grad"], ranks=n_dp, alpha=dp_alpha, beta=dp_beta,
                           micro_batches=m, units=layers + (2 if p == 1 else 1),
                           backward_s=backward, micro_batch_s=hidden_by, messages=grad_messages,
                           per_micro_batch=zero2_per_micro_batch)
    experts = moe.expert_stage_params(shape, lay) if shape.n_experts else 0.0
    if experts:   # the experts' gradients, over edp (refimpl.placement.data_parallel_axis)
        dp_s += moe.expert_sync_seconds(shape, lay, hw, gpus_per_node, bytes_, micro_batches=m,
                                        units=layers, backward_s=backward, micro_batch_s=hidden_by,
                                        messages=grad_messages, per_micro_batch=zero2_per_micro_batch)

    # --- optimizer: Adam reads and writes its states and the param, reads the grad (memory-bound)
    shard = params / n_dp if lay.zero_stage >= 1 else params
    if experts:
        shard += experts / moe.edp(lay) if lay.zero_stage >= 1 else experts
    optimizer_s = shard * (2 * bytes_["optimizer"] + bytes_["grad"] + 2 * bytes_["param"]) / hw.memory_bandwidth

    step = pipeline_s + dp_s + optimizer_s + hw.step_overhead_s
    executed = ((work["layer_flops"] * t * c) * shape.n_layers
                + work["logits_flops"] * t * c) * global_batch / b
    return {"step_time_s": step, "compute_s": m * compute_s, "tp_comm_s": m * tp_s,
            "cp_comm_s": m * cp_s, "pp_comm_s": m * pp_s, "ep_comm_s": m * ep_s,
            "bubble_s": (p - 1) * per_micro_batch,
            "dp_comm_s": dp_s, "optimizer_s": optimizer_s, "step_overhead_s": hw.step_overhead_s,
            "bubble_fraction": bubble,
            "micro_batches": m, "executed_flops": executed}


def predict(shape: ModelShape, lay: Layout, global_batch: int, hw: Hardware,
            gpus_per_node: int = 8, precision: str = "bf16", grad_messages: int = 1,
            zero2_per_micro_batch: bool = True) -> dict:
    """Memory and time of one layout, plus throughput: tflops_per_gpu counts the FLOPs executed
    (recomputation included, Megatron's convention), mfu the model's 6ND + attention FLOPs only."""
    mem = predict_memory(shape, lay, global_batch, precision)
    time = predict_time(shape, lay, global_batch, hw, gpus_per_node, precision, grad_messages,
                        zero2_per_micro_batch)
    tokens = global_batch * shape.seq_len
    model_flops = training_flops(shape.active_params, tokens, n_layers=shape.n_layers,
                                 seq=shape.seq_len, hidden=shape.d_model)
    per_gpu_s = time["step_time_s"] * lay.gpus
    return {**lay.to_dict(), **mem, **time,
            "fits": mem["memory_bytes"] <= MEMORY_HEADROOM * hw.memory_bytes,
            "tflops_per_gpu": time["executed_flops"] / per_gpu_s / 1e12,
            "mfu": model_flops / (per_gpu_s * hw.peak_flops)}
