"""Curves of a quantity against a parameter, and cost models against measurement.

`line_chart` is the generic sweep (one line per value of a column, optionally log-scaled);
`bandwidth_curves` draws bus/algorithm bandwidth against message size with the memcpy ceiling;
`fit_vs_measured` the fitted α-β model T = α + M/β over the measured times; and
`predicted_vs_measured` the planner's predicted memory and step time per layout against what a
run measured, with the line where they agree (notebooks 00, 02, 03, 06-09).
"""
from __future__ import annotations

import plotly.graph_objects as go


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


def bandwidth_curves(df, ceiling_bytes_per_s: float | None = None, y: str = "busbw",
                     title: str = "Bus bandwidth vs message size", log_y: bool = True) -> go.Figure:
    """busbw (or algbw) against message size, one line per (op, impl); refimpl dashed.

    `df` is refimpl.lab.measure.bench.sweep(...) for one world size; the ceiling is drawn as a red line.
    Log-scaled bandwidth by default: the latency-bound small sizes sit orders of magnitude below
    the plateau and would otherwise be a flat line at zero.
    """
    fig = go.Figure()
    for (op, impl), g in df.groupby(["op", "impl"], sort=False):
        fig.add_scatter(x=g["size_bytes"], y=g[y] / 1e9, mode="lines+markers", name=f"{op} ({impl})",
                        line_dash="dash" if impl == "refimpl" else "solid")
    if ceiling_bytes_per_s:
        fig.add_hline(y=ceiling_bytes_per_s / 1e9, line_color="#E45756", line_width=2,
                      annotation_text="memcpy ceiling (one core)", annotation_position="top left")
    fig.update_xaxes(type="log", title="message size M (bytes)")
    if log_y:
        fig.update_yaxes(type="log")
    fig.update_layout(title=title, yaxis_title=f"{y} (GB/s)", height=420)
    return fig


def fit_vs_measured(df, title: str = "Alpha-beta model vs measurement") -> go.Figure:
    """Measured time (markers) and the fitted T = alpha + M/beta (lines), log-log, per op.

    `df` is refimpl.lab.measure.bench.with_predictions(...) restricted to one impl and world size.
    """
    fig = go.Figure()
    palette = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D"]
    for i, (op, g) in enumerate(df.groupby("op", sort=False)):
        color = palette[i % len(palette)]
        fig.add_scatter(x=g["size_bytes"], y=g["time_s"] * 1e6, mode="markers", name=f"{op} measured",
                        marker_color=color, legendgroup=op)
        fig.add_scatter(x=g["size_bytes"], y=g["predicted_s"] * 1e6, mode="lines",
                        name=f"{op} α + M/β", line_color=color, legendgroup=op)
    fig.update_xaxes(type="log", title="message size M (bytes)")
    fig.update_yaxes(type="log", title="time (µs)")
    fig.update_layout(title=title, height=440)
    return fig


def predicted_vs_measured(df, title: str = "The planner on this machine: predicted vs measured"
                          ) -> go.Figure:
    """Two panels, one point per layout (refimpl.lab.plan.cpu's table with measured columns): memory
    per rank and step time, predicted against measured, with the line where they are equal."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("memory per rank (MiB)", "step time (ms)"))
    panels = ((1, "measured_memory_bytes", "memory_bytes", 2 ** -20),
              (2, "measured_step_time_s", "step_time_s", 1e3))
    for col, measured, predicted, scale in panels:
        x, y = df[measured] * scale, df[predicted] * scale
        fig.add_scatter(x=x, y=y, mode="markers", text=df["layout"], showlegend=False,
                        hovertemplate="%{text}<br>measured %{x:.3g}<br>predicted %{y:.3g}<extra></extra>",
                        row=1, col=col)
        lo, hi = min(x.min(), y.min()), max(x.max(), y.max())
        fig.add_scatter(x=[lo, hi], y=[lo, hi], mode="lines", line={"dash": "dash", "color": "grey"},
                        showlegend=False, hoverinfo="skip", row=1, col=col)
        fig.update_xaxes(title_text="measured", type="log", row=1, col=col)
        fig.update_yaxes(title_text="predicted", type="log", row=1, col=col)
    fig.update_layout(title=title, height=420)
    return fig
