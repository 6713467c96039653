"""Expert parallelism in the planner: what a mixture of experts changes in one layout's memory and
step time (refimpl.lab.plan.predict calls these where the shape has experts; a dense model never
reaches them, so its predictions are the same as before).

Where the parameters live is refimpl's own rule (refimpl.placement.data_parallel_axis,
refimpl.mesh): ep is carved out of the dp x cp ranks (consecutive chunks of ep ranks), each rank
of a chunk owns E/ep experts of every block of its stage, and each expert is itself split over tp
(refimpl.parallel.tp.experts: up column-parallel, down row-parallel). So

  dense parameters   over tp and pp as for a dense model; their gradients summed, and under
                     ZeRO/FSDP their states sharded, over dp x cp;
  expert parameters  E/ep experts per rank, each 1/tp; their gradients summed, and their states
                     sharded, over edp = dp x cp / ep, the ranks holding the same experts (Megatron's
                     expert-data-parallel group; with expert tensor parallelism etp = tp it is
                     Megatron's dp·cp·tp/(ep·etp) too).

Activations: the expert MLP's saved tensors are per routed slot, top_k x capacity_factor slots per
token (with balanced routing a rank's E/ep experts receive, summed, that many of its ep group's
tokens / ep: the same count as its own tokens, whatever ep is). Time: the experts' GEMMs are top_k
MLPs per token (no capacity padding: the FLOPs of the tokens kept), plus the dispatch and combine
all-to-alls of refimpl.lab.predict.strategy_cost.ep_traffic on the ep group, which nothing hides (the
experts need their tokens before they can start).
"""
from __future__ import annotations

from refimpl.lab.plan.dp_sync import dp_sync_seconds
from refimpl.lab.predict.strategy_cost import ep_traffic
from refimpl.memory import model_state_bytes


def edp(lay) -> int:
    """The expert-data-parallel size: ranks of dp x cp that hold the same experts."""
    return lay.dp * lay.cp // lay.ep


def _expert_params(shape, lay) -> float:
    """One expert on one GPU: split over tp (the down projection's bias replicated)."""
    h, w = shape.d_model, shape.mlp_width
    return 3 * h * w / lay.tp if shape.block == "llama" else (2 * h * w + w) / lay.tp + h


def _dense_block_params(shape, lay) -> float:
    """One MoE block without its experts, on one GPU: q, k, v, o weights (and q, v biases) split
    over tp; o's bias, the norms and the router replicated."""
    h = shape.d_model
    kv = (shape.kv_heads or shape.n_heads) * (h // shape.n_heads)
    if shape.block == "llama":
        split, whole = 2 * h * h + 2 * h * kv, 2 * h
    else:
        split, whole = 2 * h * h + 2 * h * kv + h + kv, h + 4 * h
    return split / lay.tp + whole + shape.n_experts * h


def expert_stage_params(shape, lay) -> float:
    """Expert parameters one GPU holds: E/ep experts of each of its stage's blocks."""
    return shape.n_layers // lay.pp * (shape.n_experts // lay.ep) * _expert_params(shape, lay)


def dense_stage_params(shape, lay) -> float:
    """Dense parameters one GPU of the first stage holds (the rank stage_params describes): its
    blocks' dense parts, the word embedding split over tp, positions replicated; the final norm
    and an untied head (split over tp) too when pp = 1."""
    h, v = shape.d_model, shape.vocab_size
    llama = shape.block == "llama"
    first = v * h / lay.tp + (0 if llama else shape.seq_len * h)
    last = (h if llama else 2 * h) + (0 if shape.tied_embeddings else v * h / lay.tp)
    return (shape.n_layers // lay.pp * _dense_block_params(shape, lay) + first
            + (last if lay.pp == 1 else 0))


def unit_params(shape, lay) -> float:
    """One block as ZeRO-3 / FSDP gathers it on one GPU: a dense block's 12h² + 13h over tp, or a
    MoE block's dense part and its E/ep experts."""
    if not shape.n_experts:
        return shape.layer_params / lay.tp
    return _dense_block_params(shape, lay) + shape.n_experts // lay.ep * _expert_params(shape, lay)


def moe_state_bytes(shape, lay, bytes_: dict) -> dict:
    """Model-state bytes of one GPU: the dense part sharded over dp x cp, the experts over edp."""
    common = dict(zero_stage=lay.zero_stage, param_bytes=bytes_["param"],
                  grad_bytes=bytes_["grad"], optimizer_bytes=bytes_["optimizer"], padded=False)
    dense = model_state_bytes(dense_stage_params(shape, lay), dp=lay.dp * lay.cp, **common)
    experts = model_state_bytes(expert_stage_params(shape, lay), dp=edp(lay), **common)
    return {"params": dense.params + experts.params, "grads": dense.grads + experts.grads,
            "optimizer": dense.optimizer + experts.optimizer, "total": dense.total + experts.total,
            "expert_bytes": experts.total, "dense_bytes": dense.total}


def mlp_activation_delta(shape, lay, batch: int, act_bytes: int) -> float:
    """Bytes one MoE block saves for backward beyond what the dense 4h MLP counted in its place.

    Slots R = top_k x capacity_factor x s/cp x b. Each slot keeps its dispatched row (h values)
    and the expert's output row (h, for the gate's gradient), and inside the expert what a dense
    MLP keeps per token: the up projection's and GELU's outputs (2w, split over tp), or SwiGLU's
    gate and up outputs and their product (3w). The router keeps its fp32 probabilities (E per
    token). The dense MLP's inside, removed: Korthikanti et al. 2022 Table 2's 16·sbh/t at 16 bits
    (its input and dropout mask, 3·sbh, stay: the MoE block has both), which is also refimpl's
    block's two 4h tensors (refimpl.memory.tp_block_activation_bytes). Grouped-query attention's
    narrower K and V are not taken off (2·(h - kv)·sbh/t per block)."""
    s, b, h, w, t = shape.seq_len // lay.cp, batch, shape.d_model, shape.mlp_width, lay.tp
    slots = shape.top_k * shape.capacity_factor * s * b
    inner = (3 if shape.block == "llama" else 2) * w / t
    moe = slots * (2 * h + inner) * act_bytes + 4 * s * b * shape.n_experts
    return moe - 8 * s * b * h / t * act_bytes   # 16·sbh/t at 2 bytes = two 4h tensors


def mlp_flops_delta(shape, lay, batch: int) -> float:
    """Forward GEMM FLOPs of one MoE block beyond the dense block's 24·b·s·h² (Narayanan et al.
    2021) on one tp rank: top_k experts (2 or 3 matrices of h x w, 2 FLOPs per multiply-add) and
    the router instead of the 4h MLP's 16·b·s·h², grouped-query K and V narrower than h."""
    s, b, h, w = shape.seq_len // lay.cp, batch, shape.d_model, shape.mlp_width
    kv = (shape.kv_heads or shape.n_heads) * (h // shape.n_heads)
    matrices = 3 if shape.block == "llama" else 2
    experts = shape.top_k * matrices * 2 * b * s * h * w
    router = 2 * b * s * h * shape.n_experts
    narrower_kv = 2 * 2 * b * s * h * (kv - h)
    return (experts + router + narrower_kv - 16 * b * s * h * h) / lay.tp


def _first_group_within_node(lay, positions, gpus_per_node: int) -> bool:
    """Do the ranks at these dp x cp positions (dp outer, cp inner, as refimpl.mesh flattens
    them) of the group holding rank 0 sit in one node? Rank of position i: its dp coordinate
    times dp's stride (pp·cp·tp) plus its cp coordinate times cp's (tp)."""
    ranks = [(i // lay.cp) * lay.pp * lay.cp * lay.tp + (i % lay.cp) * lay.tp for i in positions]
    return max(ranks) < gpus_per_node


def ep_comm_seconds(shape, lay, hw, gpus_per_node: int, act_bytes: int) -> float:
    """One micro-batch's dispatch and combine all-to-alls on the busiest stage: 4 per MoE block
    (2 forward, 2 backward; 2 more when full recomputation redoes the forward), each of the
    pairwise exchange's ep - 1 steps paying alpha, and (ep-1)/ep of the k·T rows over beta."""
    if lay.ep == 1:
        return 0.0
    layers = shape.n_layers // lay.pp
    traffic = ep_traffic(lay.micro_batch_size * shape.seq_len // lay.cp, shape.d_model, layers,
                         shape.top_k, lay.ep, bytes_per_value=act_bytes)
    alpha, beta = hw.link(_first_group_within_node(lay, range(lay.ep), gpus_per_node))
    calls = sum(count for _, _, count in traffic["calls"])
    passes = 1.5 if lay.recompute == "full" else 1.0
    return passes * (calls * (lay.ep - 1) * alpha + traffic["sent_per_rank"] / beta)


def expert_sync_seconds(shape, lay, hw, gpus_per_node: int, bytes_: dict, **sync) -> float:
    """The experts' gradient sync (refimpl.lab.plan.dp_sync, the same stages as the dense one) over
    edp, whose group is one rank of each ep chunk (dp x cp positions 0, ep, 2·ep, ...)."""
    within = _first_group_within_node(lay, range(0, lay.dp * lay.cp, lay.ep), gpus_per_node)
    alpha, beta = hw.link(within)
    return dp_sync_seconds(lay.zero_stage, param_count=expert_stage_params(shape, lay),
                           param_bytes=bytes_["param"], grad_bytes=bytes_["grad"], ranks=edp(lay),
                           alpha=alpha, beta=beta, **sync)
