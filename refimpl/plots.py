"""Plotly figures for the notebooks: timelines, memory bars, bandwidth curves, schedules.

Importing this module sets the renderer to `plotly_mimetype+notebook`: it is the one setting whose
figures render offline both in JupyterLab (trusted or not) and in an nbconvert HTML export (the
plotly.js bundle is embedded once per notebook). The default `plotly_mimetype` leaves the HTML
export empty, and the `*_connected` renderers fetch plotly.js from a CDN.

Each function takes DataFrames produced by refimpl and returns a go.Figure; no computation here.
"""
from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

pio.renderers.default = "plotly_mimetype+notebook"

# One colour per phase, used by every timeline so a reader learns them once.
PHASE_COLORS = {
    "forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B", "comm": "#E45756",
    "idle": "#DDDDDD",
}


def memory_bars(df, title: str = "Memory per category") -> go.Figure:
    """Grouped bars: one group per category, one bar per source (e.g. predicted vs measured).

    `df` columns: category, source, bytes.
    """
    fig = go.Figure()
    for source, g in df.groupby("source", sort=False):
        fig.add_bar(name=str(source), x=g["category"], y=g["bytes"] / 2**20)
    fig.update_layout(title=title, barmode="group", yaxis_title="MiB", height=380)
    return fig


def rank_timeline(df, title: str = "Per-rank timeline", max_events: int = 4000) -> go.Figure:
    """One lane per rank; each labelled range a horizontal bar coloured by its category.

    `df` is refimpl.profiling.load_trace(...); ranges are drawn on a shared time axis (ms).
    """
    shown = df[df.category.isin(list(PHASE_COLORS))].head(max_events)
    fig = go.Figure()
    for category, g in shown.groupby("category"):
        fig.add_bar(
            name=category, orientation="h", base=g.start_us / 1e3, x=g.dur_us / 1e3,
            y=[f"rank {r}" for r in g["rank"]], marker_color=PHASE_COLORS.get(category),
            hovertext=g["name"], hoverinfo="text+x")
    fig.update_layout(title=title, barmode="overlay", xaxis_title="time (ms)", height=150 + 60 *
                      max(1, shown["rank"].nunique()), yaxis_autorange="reversed")
    return fig


def line_chart(df, x: str, y: str, color: str | None = None, title: str = "",
               log_x: bool = False, log_y: bool = False) -> go.Figure:
    """A line per value of `color` (or a single line)."""
    fig = go.Figure()
    groups = df.groupby(color, sort=False) if color else [("", df)]
    for name, g in groups:
        fig.add_scatter(x=g[x], y=g[y], mode="lines+markers", name=str(name))
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, height=380)
    if log_x:
        fig.update_xaxes(type="log")
    if log_y:
        fig.update_yaxes(type="log")
    return fig
