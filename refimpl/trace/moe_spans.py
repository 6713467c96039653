"""Where an MoE step's time goes, from a profiled run's trace (refimpl.trace.profiling).

The MoE layer labels its phases `moe:router`, `moe:dispatch`, `moe:experts`, `moe:combine`
(refimpl.model.moe, refimpl.parallel.ep.dispatch), and each all-to-all inside them is a
`comm:all_to_all <bytes>B` range (forward and backward: `moe:combine.backward` sends the
gradients of the combine back along the dispatch's edges, `moe:dispatch.backward` the reverse).
`moe_spans` keeps those ranges, and for each all-to-all the innermost MoE phase it ran in.
"""
from __future__ import annotations

import pandas as pd

from refimpl.trace.profiling import load_trace

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
