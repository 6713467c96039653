"""DP's communication bottleneck as ranks grow (seed §3.1, 통신 오버헤드), predicted and measured.

With a fixed global batch each rank's compute shrinks as 1/n, its gradient all-reduce does not:
a ring of M bytes on n ranks takes 2(n-1) steps of M/n bytes each,
    T(n) = 2(n-1)·α_link + 2(n-1)/n · M/B        (Patarasuk & Yuan 2009; refimpl.cost.alpha_beta).
On 2 ranks that is 2α_link + M/B, so a 2-rank α-β fit T = α₂ + M/β₂ gives α_link = α₂/2, B = β₂,
and T(n) = (n-1)·α₂ + 2(n-1)/n · M/β₂: the latency term grows linearly in n, the bandwidth term
tends to 2M/β₂ and stays flat.
"""
from __future__ import annotations

import pandas as pd

from refimpl.cost.alpha_beta import hop_model_from_fit, predict_seconds, ring_seconds


def ring_from_two_rank_fit(n: int, message_bytes: float, alpha2: float, beta2: float) -> float:
    """T(n) of a ring all-reduce, from the α-β fit of the 2-rank sweep (module docstring)."""
    alpha_link, link = hop_model_from_fit(alpha2, beta2)
    return ring_seconds("all_reduce", message_bytes, n, alpha_link, link)


def per_step_times(summary: pd.DataFrame) -> pd.Series:
    """Per-step compute and comm (us) of the rank that waited least inside the all-reduce.

    In a training step a rank that finishes its backward first also waits inside the all-reduce
    for the others; the one that arrived last waited least, so its comm time is the transfer.
    `summary` is `profiling.summarize`'s table; overlapped time counts as both.
    """
    s = summary.assign(comm_us=(summary.comm_us + summary.overlap_us) / summary.steps,
                       compute_us=(summary.compute_us + summary.overlap_us) / summary.steps)
    return s.loc[s.comm_us.idxmin()]


def least_disturbed_times(trace: pd.DataFrame, summarize) -> pd.Series:
    """Compute and comm (us) of one step, each the least over the profiled steps (`per_step_times`
    within each step): a busy machine that takes a rank's core away only ever adds time, so the
    smallest reading of each is the nearest to its cost. `summarize` is `profiling.summarize`."""
    steps = [per_step_times(summarize(trace[trace.step == n])) for n in trace.step.dropna().unique()]
    return pd.Series({"comm_us": min(t.comm_us for t in steps),
                      "compute_us": min(t.compute_us for t in steps), "steps": len(steps)})


def bottleneck_table(fits: pd.DataFrame, summaries: dict, grad_bytes: float) -> pd.DataFrame:
    """Predicted (from n = 2) vs measured all-reduce time and comm share of the step, per n.

    `fits`: `alpha_beta.fit_table` of an all-reduce sweep indexed by world size; `summaries`: n ->
    `profiling.summarize` of a profiled dp run on n ranks, the same global batch for all.
    """
    alpha2, beta2 = fits.alpha_s[2], fits.beta_bytes_per_s[2]
    compute_2 = per_step_times(summaries[2]).compute_us * 1e-6
    rows = []
    for n, summary in sorted(summaries.items()):
        ring = ring_from_two_rank_fit(n, grad_bytes, alpha2, beta2)
        measured = per_step_times(summary)
        rows.append({"ranks": n, "all-reduce predicted (ms)": ring * 1e3,
                     "all-reduce measured (ms)": float(predict_seconds(
                         fits.alpha_s[n], fits.beta_bytes_per_s[n], grad_bytes)) * 1e3,
                     "comm share predicted": ring / (ring + compute_2 * 2 / n),
                     "comm share measured": measured.comm_frac + measured.overlap_frac})
    return pd.DataFrame(rows).set_index("ranks")
