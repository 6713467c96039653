"""Where an MoE step's time goes, from a profiled run's trace (refimpl.lab.trace.profiling).

The MoE layer labels its phases `moe:router`, `moe:dispatch`, `moe:experts`, `moe:combine`
(refimpl.model.moe, refimpl.parallel.ep.dispatch), and each all-to-all inside them is a
`comm:all_to_all <bytes>B` range (forward and backward: `moe:combine.backward` sends the
gradients of the combine back along the dispatch's edges, `moe:dispatch.backward` the reverse).
`moe_spans` keeps those ranges, and for each all-to-all the innermost MoE phase it ran in.
"""
from __future__ import annotations

import pandas as pd

from refimpl.lab.trace.profiling import load_trace

MOE_PHASES = ("moe:router", "moe:dispatch", "moe:experts", "moe:combine",
              "moe:combine.backward", "moe:dispatch.backward")
COLORS = {"moe:router": "#B279A2", "moe:dispatch": "#E45756", "moe:experts": "#4C78A8",
          "moe:combine": "#F58518", "moe:combine.backward": "#FFBF79",
          "moe:dispatch.backward": "#FF9D98", "backward": "#DDDDDD"}


def moe_spans(run) -> pd.DataFrame:
    """The MoE phase ranges and the all-to-all ranges of a run, with `inside` (the phase that
    contains each all-to-all) and `category` set to the phase name (for plots.rank_timeline)."""
    df = load_trace(run, include_ops=True)
    phases = df[df.name.isin(MOE_PHASES + ("backward",))].copy()
    phases["category"] = phases["name"]
    a2a = df[df.name.str.startswith("comm:all_to_all")].copy()   # our labels, not gloo's own
    a2a["inside"] = [_container(phases, r) for r in a2a.itertuples()]
    return pd.concat([phases, a2a], ignore_index=True).sort_values(["rank", "start_us"])


def _container(phases: pd.DataFrame, r) -> str | None:
    same = phases[(phases["rank"] == r.rank) & (phases.start_us <= r.start_us)
                  & (phases.start_us + phases.dur_us >= r.start_us + r.dur_us)]
    if same.empty:
        return None
    return same.sort_values("dur_us").name.iloc[0]   # the innermost range


def time_per_rank(spans: pd.DataFrame) -> pd.DataFrame:
    """Per rank, the mean milliseconds per profiled step spent computing its experts
    (`moe:experts`) and inside the MoE's data all-to-alls (every `comm:all_to_all` of more than
    the count exchange's few bytes). Under gloo a rank that reaches an all-to-all first waits
    inside it for the others: a rank with less work shows it as all-to-all time. On CUDA the
    labels' kernel time (gpu_dur_us) is read instead, as the CPU range only times the launch."""
    stepped = spans[spans.step.notna()].copy()
    if "gpu_dur_us" in stepped and stepped.gpu_dur_us.notna().any():
        stepped["dur_us"] = stepped.gpu_dur_us
    experts = stepped[stepped.name == "moe:experts"]
    a2a = stepped[stepped.name.str.startswith("comm:all_to_all") & (stepped.bytes > 1024)]
    steps = stepped.groupby("rank").step.nunique()
    return pd.DataFrame({"experts ms / step": experts.groupby("rank").dur_us.sum() / steps / 1e3,
                         "all-to-all ms / step": a2a.groupby("rank").dur_us.sum() / steps / 1e3})
