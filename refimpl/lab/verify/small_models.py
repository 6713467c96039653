"""Why a small model is hard to speed up by splitting it (seed 003), measured and predicted.

The lecture: "작은 모델은 오히려 병렬화로 속도를 올리기 어렵다. 층 수도 적고 행렬도 작아 쪼갤 여지가
없기 때문이다" (few layers, small matrices: nothing worth splitting). Tensor parallelism shows it
most plainly. On t ranks each rank computes 1/t of a layer's 72·b·s·h²·(1 + s/(6h)) FLOPs
(refimpl.lab.predict.tp_comm.flops_per_layer), but every rank still all-reduces the whole b·s·h
activation four times per layer, and every all-reduce pays the ring's latency however small its
message. Compute grows as h², traffic as h, latency not at all: the narrower the model, the larger
the share of a step its ranks spend communicating, and the less the split buys.

`measure` trains models of growing width (same depth, same global batch) under `single` and under
`tp` on t ranks, times both, and reads from three profiled tp steps per width:
  * the activation all-reduces of the residual stream, counted and sized (to compare with
    tp_comm's (4L + 2) messages of b·s·h values: 4 per layer, the embedding's and the LM head's);
  * per step, the communication and the compute time of the rank that waited least inside the
    collectives (refimpl.lab.predict.dp_scaling.per_step_times: under gloo a rank that arrives first
    waits inside the call for the other, which is not transfer time), each the least of three
    recorded steps (a core taken away by a busy machine only adds time).
`predicted_shares` puts beside them what the arithmetic says the communication share is, with no
run: the α-β ring model (a fit on this machine's ranks, notebook 02's method) against the FLOPs at
this machine's matmul rate, and the same layers on an H100 preset (refimpl.lab.predict.hardware), where
the seed's claim is about GPUs.
"""
from __future__ import annotations

import pandas as pd

from refimpl.config import DTYPES, TrainConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.predict import tp_comm
from refimpl.lab.predict.dp_scaling import least_disturbed_times
from refimpl.lab.trace import capture, profiling
from refimpl.model import GPTConfig
from refimpl.train import train_on_ranks

# From tiny to about the 4M parameters a test can afford: 2 blocks, widths 64, 192, 384.
WIDTHS = (64, 192, 384)


def width_sweep(widths=WIDTHS, *, n_layers: int = 2, n_heads: int = 4, vocab_size: int = 128,
                seq_len: int = 32) -> list[GPTConfig]:
    """The same GPT at each width: only the matrices grow (heads divide every width by tp = 2, 4)."""
    return [GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=h, n_heads=n_heads,
                      n_layers=n_layers) for h in widths]


def share(comm_s: float, compute_s: float) -> float:
    return comm_s / (comm_s + compute_s)


def _configs(models, tp: int, steps: int, global_batch: int, group: str) -> dict:
    """Per width: tp timed, tp profiled (one warm-up step and three recorded), single timed."""
    runs = {}
    for m in models:
        timed = TrainConfig(strategy="tp", nproc=tp, steps=steps, global_batch=global_batch,
                            seq_len=m.seq_len, model=m)
        runs[m.d_model] = (timed, capture.profiled(timed.with_(steps=4), group, f"tp{tp}-h{m.d_model}"),
                           timed.with_(strategy="single", nproc=1))
    return runs


def residual_all_reduces(trace: pd.DataFrame, message_bytes: int, rank: int = 0) -> pd.Series:
    """Per profiled step, rank `rank`'s all-reduces of a `message_bytes` message (the b·s·h
    activation of the residual stream; the loss's per-token ones are b·s values)."""
    calls = trace[(trace["rank"] == rank) & trace.step.notna() & (trace.op == "all_reduce")
                  & (trace.bytes == message_bytes)]
    return calls.groupby("step").size()


def largest_all_reduce(trace: pd.DataFrame, rank: int = 0) -> int:
    """The biggest all-reduce message rank `rank` made in its profiled steps, read off the trace's
    labels (comm:all_reduce <bytes>B): in a TP step, the residual stream's b·s·h activation."""
    calls = trace[(trace["rank"] == rank) & trace.step.notna() & (trace.op == "all_reduce")]
    return int(calls.bytes.max()) if len(calls) else 0


def measure(models: list[GPTConfig], *, tp: int = 2, steps: int = 3, global_batch: int = 8,
            group: str = "06_tensor_parallel/small-models") -> pd.DataFrame:
    """One row per model: single's and tp's step times and the speed-up (no profiler: it costs a
    fixed time per operator, which would weigh on the small model most), and from profiled tp
    steps the residual all-reduces and the communication share of the step (module docstring).
    Every tp run shares one launch; single runs in this process, one thread, as a rank does."""
    runs = _configs(models, tp, steps, global_batch, group)
    done = iter(train_several_on_ranks([c for timed, traced, _ in runs.values() for c in (timed, traced)]))
    rows = []
    for (h, (timed, traced, single_cfg)), m in zip(runs.items(), models, strict=True):
        tp_run, _ = next(done), next(done)
        single = train_on_ranks(single_cfg)
        trace = profiling.load_trace(traced.trace_dir)
        times = least_disturbed_times(trace, profiling.summarize)
        message = global_batch * m.seq_len * h * DTYPES[timed.dtype].itemsize
        calls = residual_all_reduces(trace, message)
        rows.append({"d_model": h, "n_params": tp_run["n_params"],
                     "single step (ms)": single["step_time_s"] * 1e3,
                     f"tp{tp} step (ms)": tp_run["step_time_s"] * 1e3,
                     "speed-up": single["step_time_s"] / tp_run["step_time_s"],
                     "residual all-reduces / step": int(calls.min()) if len(calls) else 0,
                     "all-reduce message (B)": message,
                     "largest all-reduce traced (B)": largest_all_reduce(trace),
                     "comm ms / step": times.comm_us / 1e3, "compute ms / step": times.compute_us / 1e3,
                     "comm share measured": share(times.comm_us, times.compute_us)})
    return pd.DataFrame(rows).set_index("d_model")


def predicted_shares(models: list[GPTConfig], *, tp: int, global_batch: int, alpha_hop: float,
                     link: float, matmul_rate: float, dtype_bytes: int, gpu: str = "h100-sxm"
                     ) -> pd.DataFrame:
    """Per model, the communication share of its layers' time that the arithmetic predicts, with no
    run: on this machine (the ring with the fitted hop latency and link rate, the FLOPs at
    `matmul_rate`, values of `dtype_bytes`) and on `gpu`'s preset inside a node (bf16, its
    achievable link and GEMM rate). Per layer, so the depth cancels; the layer's FLOPs per byte
    sent grows as h."""
    rows = []
    for m in models:
        here = tp_comm.LayerShape(global_batch, m.seq_len, m.d_model, dtype_bytes)
        comm = tp_comm.comm_seconds_per_layer(here, tp, alpha_hop, link)
        compute = tp_comm.flops_per_layer(here) / tp / matmul_rate
        rows.append({"d_model": m.d_model,
                     "FLOPs per byte sent": tp_comm.flops_per_layer(here) / tp
                     / tp_comm.bytes_per_layer(here.b, here.s, here.h, tp, dtype_bytes),
                     "comm share predicted, this machine": share(comm, compute),
                     f"comm share predicted, {gpu}": share(*tp_comm.comm_and_compute_seconds(
                         tp_comm.LayerShape(global_batch, m.seq_len, m.d_model), tp, gpu))})
    return pd.DataFrame(rows).set_index("d_model")
