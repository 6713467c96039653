"""Why smaller micro-batches use a device less well (seed §3.4): the work per operator shrinks with
the micro-batch, the number of operators does not.

More micro-batches shrink the pipeline bubble (refimpl.parallel.pp.schedules.bubble_fraction), but
for a fixed global batch each one is smaller. A forward + backward launches the same operators
whatever the micro-batch size b (counted here with torch.profiler), so the fixed cost of each --
a CUDA kernel launch is a few microseconds; here Python and op dispatch -- is paid b times less
often per sequence by a larger micro-batch, and a GEMM with fewer rows fills fewer of a GPU's
streaming multiprocessors. `per_micro_batch` counts the operators of one step at each b (asserted
equal in notebook 07) and times it on this machine (printed, not asserted: wall time).
"""
from __future__ import annotations

import statistics
import time

import pandas as pd

from refimpl.lab.trace.native_stderr import quiet_profiler_in_notebook
from refimpl.model import GPTConfig, build_model, lm_loss, synthetic_batch


def _step(model, batch):
    lm_loss(model(batch.inputs), batch.targets).backward()
    model.zero_grad(set_to_none=True)


def operator_calls(model, batch) -> int:
    """aten operators one forward + backward launches (each would be at least one kernel on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_profiler_in_notebook(), profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, batch)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def per_micro_batch(cfg: GPTConfig, sizes=(1, 2, 4, 8), repeats: int = 5, seed: int = 0) -> pd.DataFrame:
    """One row per micro-batch size b: operators per step and per sequence, and this machine's
    median step time per sequence (ms)."""
    model = build_model(cfg, seed)
    rows = []
    for b in sizes:
        batch = synthetic_batch(cfg, b, cfg.seq_len, seed, 0)
        _step(model, batch)                               # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _step(model, batch)
            times.append(time.perf_counter() - start)
        ops = operator_calls(model, batch)
        rows.append({"micro-batch": b, "operators / step": ops, "operators / sequence": ops / b,
                     "ms / sequence (this machine)": 1e3 * statistics.median(times) / b})
    return pd.DataFrame(rows)
