"""What tensor parallelism costs on the wire, and why it stays inside a node (seed §3.3 단점; 003).

Bytes. Per transformer layer and micro-batch, 2 all-reduces of the b·s·h activation in forward and
2 in backward (Megatron-LM's f and g); a ring all-reduce of M bytes sends 2(t-1)/t·M per rank, so
each rank sends 8·b·s·h·(t-1)/t values per layer per micro-batch (Narayanan et al. 2021, §3.2,
"Tensor and Pipeline Model Parallelism": counted in values, per device; times bytes per value here).
The same section counts a pipeline boundary: b·s·h values per micro-batch, point to point, once
forward and once backward (`pp_boundary_bytes`).
Sequence parallelism replaces each all-reduce by an all-gather + a reduce-scatter, (t-1)/t·M each:
the same bytes in twice the calls (Korthikanti et al. 2022, §4.2.2).

Time. A ring all-reduce over t ranks is 2(t-1) steps, each a latency α_hop plus a chunk of M/t
bytes at the link bandwidth B: T = 2(t-1)·α_hop + 2(t-1)/t · M/B (Patarasuk & Yuan 2009;
refimpl.cost.alpha_beta.ring_seconds). An α-β fit at t = 2 (T = α + M/β,
refimpl.cost.alpha_beta.fit_alpha_beta) gives α_hop = α/2 and B = β (alpha_beta.hop_model_from_fit),
from which the same model predicts other t.

Compute, to compare with. One layer's forward is 24·b·s·h² + 4·b·s²·h FLOPs (Narayanan et al.
2021, §5.1: the four h×h-sized matmuls and the 4h MLP, plus scores and S·V); backward twice that:
72·b·s·h²·(1 + s/(6h)) per layer, split t ways under TP.

Links and rates come from the planner's GPU presets (refimpl.lab.predict.hardware: the datasheet
numbers and their sources, written once): NVLink inside a node, one InfiniBand port per GPU across
nodes; `comm_to_compute` uses what a preset says is *achievable* (Hardware.link: latency and the
link fraction; Hardware.matmul_rate: the GEMM fraction of the peak), the one ratio notebooks 06 and
09 (refimpl.lab.plan.composition.placement_rule) both print.

Overlap. By default nothing in refimpl runs a TP collective under compute: each sits on the
critical path of its layer, so a layer takes compute·(1 + r) for a ratio r. `--set tp_overlap=true`
(refimpl.lab.tensor) decomposes SP's all-gather + matmul and matmul + reduce-scatter over
the ring; `decomposed_ring_seconds` is what that can save. Megatron-LM overlaps in the backward of
a column-parallel layer (megatron/core/tensor_parallel/layers.py,
LinearWithGradAccumulationAndAsyncCommunication.backward; Korthikanti et al. 2022, §4.2.2), each
collective under the GEMM that does not need its result: under SP the all-gather of the layer's
s/t input (the LayerNorm output) runs under the input-gradient GEMM dY·W (the weight gradient
dW = dYᵀ·X needs the gathered X, so it waits), and the reduce-scatter of that input gradient runs
under the weight-gradient GEMM; without SP the all-reduce of the input gradient runs under the
weight-gradient GEMM. PyTorch's async-TP splits the all-gather + matmul into chunks so each
chunk's transfer runs under the previous chunk's GEMM (torch.distributed._symmetric_memory,
"micro-pipelining"). `layer_time_over_compute` is what a share of overlap would buy: at best the
layer takes max(compute, comm).
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from refimpl.cost.alpha_beta import ring_seconds
from refimpl.lab.predict.hardware import Hardware, get_hardware
from refimpl.lab.predict.presets import get_model
from refimpl.parallel.tp.attention import kv_split


def bytes_per_layer(b: int, s: int, h: int, t: int, dtype_bytes: int = 2) -> float:
    """Bytes one rank sends per layer per micro-batch, forward + backward (Narayanan 2021)."""
    return 8 * b * s * h * (t - 1) / t * dtype_bytes


def residual_all_reduces_per_step(n_layers: int) -> int:
    """All-reduces of the b·s·h residual stream in one step of refimpl's whole TP GPT (no SP):
    4 per layer (Megatron's f and g, forward and backward), plus the vocabulary-parallel embedding's
    sum of its rows (forward) and the column-parallel LM head's input gradient (backward)."""
    return 4 * n_layers + 2


def calls_per_layer(sequence_parallel: bool = False) -> dict:
    """Collectives per layer per micro-batch, forward + backward."""
    if sequence_parallel:
        return {"all_gather": 4, "reduce_scatter": 4}
    return {"all_reduce": 4}


@dataclass(frozen=True)
class LayerShape:
    b: int
    s: int
    h: int
    dtype_bytes: int = 2


def comm_seconds_per_layer(shape: LayerShape, t: int, alpha_hop: float, link: float,
                           sequence_parallel: bool = False) -> float:
    message = shape.b * shape.s * shape.h * shape.dtype_bytes
    return sum(n * ring_seconds(op, message, t, alpha_hop, link)
               for op, n in calls_per_layer(sequence_parallel).items())


def flops_per_layer(shape: LayerShape) -> float:
    """Forward + backward FLOPs of one layer, whole (divide by t for one TP rank)."""
    b, s, h = shape.b, shape.s, shape.h
    return 72 * b * s * h * h * (1 + s / (6 * h))


def comm_and_compute_seconds(shape: LayerShape, t: int, gpu: str | Hardware = "h100-sxm",
                             within_node: bool = True) -> tuple[float, float]:
    """(TP communication seconds, compute seconds) of one layer's forward + backward on one rank of
    a ring of t GPUs, with a preset's achievable link (alpha, fraction of the rate) and GEMM rate."""
    hw = gpu if isinstance(gpu, Hardware) else get_hardware(gpu)
    alpha, link = hw.link(within_node)
    return comm_seconds_per_layer(shape, t, alpha, link), flops_per_layer(shape) / t / hw.matmul_rate


def comm_to_compute(shape: LayerShape, t: int, gpu: str | Hardware = "h100-sxm",
                    within_node: bool = True) -> float:
    """TP communication time / compute time per layer: > 1, the GPUs wait longer than they compute;
    below 1 the communication still adds r·compute to the layer unless something overlaps it."""
    comm, compute = comm_and_compute_seconds(shape, t, gpu, within_node)
    return comm / compute


def layer_time_over_compute(ratio: float, overlapped: float = 0.0) -> float:
    """A layer's time over its compute time when `overlapped` (0..1) of its communication runs
    under compute: 1 + r without overlap, max(1, r) at best (only as much as the compute can hide)."""
    if not 0.0 <= overlapped <= 1.0:
        raise ValueError(f"overlapped must be in [0, 1] (got {overlapped})")
    return 1.0 + (ratio - min(overlapped * ratio, 1.0))


def decomposed_ring_seconds(t: int, chunk_bytes: float, chunk_matmul_s: float, alpha_hop: float,
                            link: float, engine_share: float = 1.0) -> dict:
    """An all-gather + matmul (or matmul + reduce-scatter) over t ranks, serial and decomposed into
    per-chunk steps (Wang et al. 2022, ASPLOS '23, §3; refimpl.lab.tensor.ring).

    Serial: the ring collective of t chunks of m bytes, T_c = (t-1)·(α + m/B) (`ring_seconds`,
    Patarasuk & Yuan 2009), then the t chunk matmuls, t·c. Decomposed: each of the t-1 ring steps
    sends one chunk while one chunk's matmul runs, and one matmul runs alone. Only the share σ of a
    transfer that hardware other than the matmul's moves (`engine_share`, `transfer_engine_share`)
    can run beside it: a step takes max(σ·(α + m/B), c) + (1-σ)·(α + m/B), so the decomposition
    saves (t-1)·min(σ·(α + m/B), c). With σ = 1 (a GPU: a copy engine or NCCL's kernels move the
    bytes) that is whichever of a step's transfer and its matmul is shorter, at best the whole
    collective; with σ = 0 (CPU ranks on every core: the cores that multiply also copy) nothing.
    """
    step = alpha_hop + chunk_bytes / link     # one ring step: α + m/B
    collective = ring_seconds("all_gather", t * chunk_bytes, t, alpha_hop, link)
    serial = collective + t * chunk_matmul_s
    beside = engine_share * step              # the part of the transfer that can run beside c
    overlapped = (t - 1) * (max(beside, chunk_matmul_s) + step - beside) + chunk_matmul_s
    return {"serial_s": serial, "overlapped_s": overlapped, "saving_s": serial - overlapped,
            "collective_s": collective}


def hidden_per_ring_step(chunk_bytes: float, chunk_matmul_s: float, alpha_hop: float,
                         link: float, engine_share: float = 1.0) -> float:
    """What one step of a decomposed ring can hide: min(σ·(α + m/B), c), the shorter of the share
    of its chunk's transfer that runs on hardware of its own and the matmul beside it
    (`decomposed_ring_seconds` sums t-1 of these)."""
    return min(engine_share * (alpha_hop + chunk_bytes / link), chunk_matmul_s)


def transfer_engine_share(device_type: str, ranks: int, cores: int, threads_per_rank: int = 1) -> float:
    """σ of `decomposed_ring_seconds`: the share of a transfer that runs beside a rank's matmul.

    GPUs: 1, the model's assumption (Wang et al. 2022): the bytes move on a copy engine or on NCCL's
    kernels while the matmul's run (NCCL's kernels take a few SMs from it: not counted). CPU ranks
    on gloo: the bytes are copied by CPU cores (over loopback TCP the sender's write and the
    receiver's read are both memcpys), so a copy runs beside a matmul only on a core no rank
    computes on: the spare cores, cores - ranks x threads per rank (one each under refimpl.launch),
    shared by the ranks, at most one each. 2 ranks on 2 cores: 0. The model then predicts no saving
    from the overlap, and the two paths differ only by their own costs (the decomposition's smaller
    matmuls and extra messages against one collective call): tp_overlap / tp measured 0.83-1.06
    in ten runs on this project's 2-core machines (median 1.02), within the bench's run-to-run
    spread. refimpl.lab.verify.tp_overlap's `transfer_beside_matmul` measures σ itself on 2 ranks; on
    2 cores, seven runs: -0.15 to 0.25 (median 0.05) with both ranks multiplying, 0.17 to 0.53
    (median 0.43) with one rank idle (the model: one spare core for two ranks, 0.5)."""
    if device_type == "cuda":
        return 1.0
    spare = cores - ranks * threads_per_rank
    return min(1.0, max(0, spare) / ranks)


def pp_boundary_bytes(b: int, s: int, h: int, dtype_bytes: int = 2) -> float:
    """Bytes one pipeline boundary carries per micro-batch, forward + backward: the activation
    b·s·h once each way (Narayanan et al. 2021, §3.2), point to point between two GPUs."""
    return 2 * b * s * h * dtype_bytes


def prediction_table(n_layers: int, batch: int, hidden: int, alpha_hop: float, link: float,
                     dtype_bytes: int, tps=(2, 4, 8), seq_lens=(64, 128, 256, 512, 1024, 2048),
                     with_ends: bool = False):
    """Per step, one rank's TP bytes and predicted seconds at each (tp, seq_len): the α-β ring
    model with a fitted hop latency and link rate (notebook 06 §7). `with_ends`: count the
    embedding's and the LM head's all-reduce too (`residual_all_reduces_per_step`), as a whole
    model's step makes them; without, the layers' 4 per layer alone."""
    calls = residual_all_reduces_per_step(n_layers) if with_ends else 4 * n_layers
    rows = []
    for t in tps:
        for s in seq_lens:
            message = batch * s * hidden * dtype_bytes
            rows.append({"tp": t, "seq_len": s,
                         "bytes/rank/step": calls * bytes_per_layer(batch, s, hidden, t, dtype_bytes) / 4,
                         "predicted comm s/step": calls * ring_seconds("all_reduce", message, t, alpha_hop, link)})
    return pd.DataFrame(rows)


def speed_up_over_one_gpu(ratio: float, t: int, overlapped: float = 0.0) -> float:
    """One layer's throughput on t GPUs over one GPU's: t / (layer time / compute)."""
    return t / layer_time_over_compute(ratio, overlapped)


def placement_table(shapes: dict, tps=(2, 4, 8), gpu: str | Hardware = "h100-sxm") -> pd.DataFrame:
    """Per named LayerShape and tp: comm/compute inside a node (NVLink) and across nodes
    (InfiniBand), the layer's time over its compute without overlap, and the speed-up over one
    GPU on either link (notebook 06 §8: the seed's placement rule as arithmetic)."""
    rows = []
    for name, shape in shapes.items():
        for t in tps:
            row = {"layer": name, "tp": t}
            for link, inside in (("NVLink", True), ("InfiniBand", False)):
                row[f"{link} comm/compute"] = comm_to_compute(shape, t, gpu, within_node=inside)
            row["layer time / compute, NVLink, no overlap"] = layer_time_over_compute(row["NVLink comm/compute"])
            for link in ("NVLink", "InfiniBand"):
                row[f"speed-up over 1 GPU, {link}"] = speed_up_over_one_gpu(row[f"{link} comm/compute"], t)
            rows.append(row)
    return pd.DataFrame(rows)


def layer_of(model: str, micro_batch: int = 1) -> LayerShape:
    """A published model's layer (refimpl.lab.predict.presets) at its own context length, bf16."""
    shape, _ = get_model(model)
    return LayerShape(micro_batch, shape.seq_len, shape.d_model)


def kv_heads_per_rank(n_kv_heads: int, t: int) -> tuple[int, int]:
    """Grouped-query attention under TP: (key/value heads each rank holds, ranks holding each one).
    With at least t KV heads they split like the query heads; with fewer, every rank still needs
    the KV head its query heads use, so each KV head is replicated over t / n_kv ranks (as vLLM's
    QKVParallelLinear does): its weights and its K/V activations stop shrinking with t. The split
    is the mechanism's own (refimpl.parallel.tp.attention.kv_split)."""
    return kv_split(n_kv_heads, t)


def gqa_table(d_model: int, n_heads: int, n_kv_heads: int, tps=(2, 4, 8, 16),
              dtype_bytes: int = 2) -> pd.DataFrame:
    """Grouped-query attention's projections per TP rank: query heads and K/V heads each rank
    holds (`kv_heads_per_rank`), and the bytes of its W_Q slice and of its W_K + W_V slices (each
    head an h × head_dim block), indexed by tp."""
    head_dim = d_model // n_heads
    rows = []
    for t in tps:
        kv, sharing = kv_heads_per_rank(n_kv_heads, t)
        rows.append({"tp": t, "query heads / rank": n_heads // t, "K/V heads / rank": kv,
                     "ranks per K/V head": sharing,
                     "K,V weight MiB / rank": 2 * d_model * head_dim * kv * dtype_bytes / 2**20,
                     "Q weight MiB / rank": d_model * head_dim * (n_heads // t) * dtype_bytes / 2**20})
    return pd.DataFrame(rows).set_index("tp")
