"""Where a step's time goes, drawn on a time axis or as shares of it.

`rank_timeline` draws a profiled trace as one lane per rank (and per rank's GPU on a CUDA run),
`pipeline_gantt` a pipeline schedule as one lane per stage with each F/B/W action labelled, and
`time_split_bars` the fraction of the profiled steps each rank spent computing, communicating
under compute, communicating alone and idle. All colour phases with `PHASE_COLORS`.
"""
from __future__ import annotations

import plotly.graph_objects as go

from refimpl.lab.plots.style import PHASE_COLORS


def rank_timeline(df, title: str = "Per-rank timeline", max_events: int = 4000,
                  colors: dict | None = None) -> go.Figure:
    """One lane per rank; each labelled range a horizontal bar coloured by its category.

    `df` is refimpl.lab.trace.profiling.load_trace(...); ranges are drawn on a shared time axis (ms).
    A CUDA run's kernels get a second lane per rank, "rank r GPU" (NCCL kernels as gpu_comm).
    `colors`: category -> colour, for other categories than the phases (e.g. MoE's labels).
    """
    colors = colors or PHASE_COLORS
    shown = df[df.category.isin(list(colors))].head(max_events)
    fig = go.Figure()
    for category, g in shown.groupby("category"):
        fig.add_bar(
            name=category, orientation="h", base=g.start_us / 1e3, x=g.dur_us / 1e3,
            y=[f"rank {r}" + (" GPU" if category.startswith("gpu") else "") for r in g["rank"]],
            marker_color=colors.get(category),
            hovertext=g["name"], hoverinfo="text+x")
    fig.update_layout(title=title, barmode="overlay", xaxis_title="time (ms)", height=150 + 60 *
                      max(1, shown["rank"].nunique() * (2 if shown.category.str.startswith("gpu").any()
                                                         else 1)), yaxis_autorange="reversed")
    return fig


def pipeline_gantt(df, title: str = "Pipeline schedule") -> go.Figure:
    """One lane per pipeline rank; each action (F3, B3, W3, F3.1) a bar labelled with its name.

    `df` columns: rank, action, start, end (unit times from refimpl.lab.pipeline.simulate, or ms
    from a trace): forward blue, backward orange, weight gradient (zero-bubble W) purple; the
    white gaps are the bubble.
    """
    colors = {"F": PHASE_COLORS["forward"], "B": PHASE_COLORS["backward"], "W": "#B279A2"}
    fig = go.Figure()
    for kind, g in df.groupby(df["action"].str[0], sort=False):
        fig.add_bar(name={"F": "forward", "B": "backward", "W": "weight grad"}[kind],
                    orientation="h", base=g["start"], x=g["end"] - g["start"],
                    y=[f"stage {r}" for r in g["rank"]], marker_color=colors[kind],
                    marker_line_color="white", marker_line_width=1, text=g["action"],
                    textposition="inside", insidetextanchor="middle", hoverinfo="text+x")
    fig.update_layout(title=title, barmode="overlay", xaxis_title="time", yaxis_autorange="reversed",
                      height=120 + 50 * max(1, df["rank"].nunique()))
    return fig


def time_split_bars(summary, title: str = "Where a step's time goes") -> go.Figure:
    """Stacked bars per (strategy, rank): compute only, comm hidden under compute, comm only, idle.

    `summary` is refimpl.lab.trace.profiling.summarize(...) for several runs, concatenated with a
    `strategy` column.
    """
    parts = [("compute_frac", "compute only", PHASE_COLORS["forward"]),
             ("overlap_frac", "comm hidden under compute", "#B279A2"),
             ("comm_frac", "comm only (exposed)", PHASE_COLORS["comm"]),
             ("idle_frac", "idle", PHASE_COLORS["idle"])]
    x = [summary["strategy"].astype(str), [f"rank {r}" for r in summary["rank"]]]
    fig = go.Figure()
    for column, name, color in parts:
        fig.add_bar(name=name, x=x, y=summary[column] * 100, marker_color=color)
    fig.update_layout(title=title, barmode="stack", yaxis_title="% of the profiled steps",
                      height=400)
    return fig
