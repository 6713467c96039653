"""The CPU preset's compute terms, fitted to the reference's own step on this machine (refimpl.lab.plan.cpu
uses them; refimpl.lab.measure.this_machine measures the rest: alpha-beta, memcpy)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from refimpl.config import TrainConfig
from refimpl.lab.measure.this_machine import measure_cpu_preset
from refimpl.lab.plan.predict import PRECISIONS, Layout, micro_batch_work, predict
from refimpl.lab.predict.hardware import Hardware
from refimpl.lab.predict.presets import ModelShape
from refimpl.model import GPTConfig
from refimpl.train import train_on_ranks


def shape_of(cfg: GPTConfig, seq_len: int) -> ModelShape:
    """The planner's shape of refimpl's GPT(cfg) at `seq_len` (a MoE config's experts too)."""
    experts = {} if not cfg.n_experts else dict(
        n_experts=cfg.n_experts, top_k=cfg.top_k, ffn_hidden=cfg.mlp_ratio * cfg.d_model,
        capacity_factor=cfg.capacity_factor)
    return ModelShape(cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab_size, seq_len,
                      tied_embeddings=cfg.tie_embeddings, **experts)


def calibrate_compute(hw: Hardware, cfg: GPTConfig | None = None, seq_len: int = 32,
                      runs=((1, 1), (2, 1), (4, 1), (4, 2), (4, 4)), steps: int = 5) -> Hardware:
    """Fit the preset's compute terms to the reference itself: `single` on one thread, at a few
    (global batch, micro-batches). A step is T = FLOPs / rate + passes * per-pass cost + a fixed
    cost per step + the planner's memory-bound ops and optimizer; least squares over the runs
    gives the three. The batch moves the FLOPs alone, the micro-batches the passes alone (each
    micro-batch passes every block), so the per-pass and per-step costs are told apart: with the
    batch alone (one micro-batch) they were one intercept, and a layout of m micro-batches paid
    the whole of it m times. The isolated measurements (refimpl.lab.measure.this_machine:
    measure_matmul_rate's 512 x 512 matmul, measure_block_overhead's one-token block pass) miss
    the tiny model's thin GEMMs, the loss, the optimizer call and the bookkeeping: on the 2-core
    CI machine they predicted `single`'s step ~1.5x too fast."""
    cfg = cfg or GPTConfig()
    shape = shape_of(cfg, seq_len)
    no_compute = replace(hw, peak_flops=float("inf"), block_overhead_s=0.0, step_overhead_s=0.0)
    rows, targets = [], []
    for b, m in runs:
        measured = train_on_ranks(TrainConfig(strategy="single", nproc=1, global_batch=b,
                                              micro_batches=m, seq_len=seq_len, steps=steps,
                                              model=cfg, device="cpu"))
        lay = Layout(micro_batch_size=b // m)
        work = micro_batch_work(shape, lay, PRECISIONS["fp32"]["activation"])
        rest = predict(shape, lay, b, no_compute, precision="fp32")["step_time_s"]
        rows.append([m * work["flops"], m * work["block_passes"], 1.0])
        targets.append(measured["step_time_s"] - rest)
    inv_rate, per_pass, per_step = nonnegative_least_squares(np.array(rows, dtype=float),
                                                             np.maximum(np.array(targets), 0.0))
    return replace(hw, peak_flops=1.0 / max(inv_rate, 1e-30), gemm_fraction=1.0,
                   block_overhead_s=per_pass, step_overhead_s=per_step,
                   source=hw.source + "; compute fitted to single's step")


def nonnegative_least_squares(a: np.ndarray, t: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0: noise on a busy machine can push one below
    zero; that one is then held at 0 and the others refitted (an active set, as
    refimpl.cost.alpha_beta.fit_alpha_beta keeps alpha and beta non-negative)."""
    free = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, free], t, rcond=None)
        if (coef >= 0).all() or len(free) == 1:
            out = [0.0] * a.shape[1]
            for i, c in zip(free, coef):
                out[i] = max(float(c), 0.0)
            return out
        free.pop(int(np.argmin(coef)))


def calibrated_cpu_preset(world_size: int = 4, cfg: GPTConfig | None = None,
                          seq_len: int = 32) -> Hardware:
    """This machine for the planner: the alpha-beta fit of an all-reduce on `world_size` gloo ranks
    (on the 2-core CI machine alpha per ring step is ~4x larger on 4 ranks than on 2: ranks that
    outnumber the cores wait for the scheduler), memcpy bandwidth, and the compute terms fitted to
    the reference's own step."""
    return calibrate_compute(measure_cpu_preset(world_size=world_size), cfg, seq_len)
