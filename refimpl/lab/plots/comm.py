"""What the collectives move and how long they take (notebooks 01, 02, 04).

`reach_heatmaps` shows, per primitive, whose input reached whom; `bytes_sent_bars` the bytes each
rank sent against the prediction; `comm_time_bars` the profiled time per op and rank; and
`comm_volume_bars` the bytes per rank per step each strategy moves, in units of the model's size.
"""
from __future__ import annotations

import plotly.graph_objects as go


def reach_heatmaps(reach: dict, title: str = "Whose data reaches whom") -> go.Figure:
    """One small heatmap per primitive: cell (k, j) lit when rank k's input reached rank j.

    `reach` maps a primitive's name to its n x n 0/1 matrix (refimpl.lab.measure.primitives.dependency).
    """
    from plotly.subplots import make_subplots

    names = list(reach)
    cols = 3
    rows = -(-len(names) // cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=names, horizontal_spacing=0.08,
                        vertical_spacing=0.12)
    for i, name in enumerate(names):
        z = [[int(v) for v in row] for row in reach[name]]
        n = len(z)
        fig.add_heatmap(z=z, x=[f"to {j}" for j in range(n)], y=[f"from {k}" for k in range(n)],
                        colorscale=[[0, "#F2F2F2"], [1, "#E45756"]], showscale=False, zmin=0, zmax=1,
                        row=i // cols + 1, col=i % cols + 1)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, height=260 * rows)
    return fig


def bytes_sent_bars(df, message_bytes: int,
                    title: str = "Bytes each rank sent, in units of the message size M") -> go.Figure:
    """Bars of counted bytes / M per collective and rank; a black tick marks the prediction.

    `df` is refimpl.lab.measure.traffic.traffic_table(...): collective, rank, sent / M, predicted_bytes.
    """
    fig = go.Figure()
    for rank, g in df.groupby("rank"):
        fig.add_bar(name=f"rank {rank}", x=g["collective"], y=g["sent / M"], offsetgroup=str(rank))
        fig.add_scatter(name=f"predicted, rank {rank}", x=g["collective"], offsetgroup=str(rank),
                        y=g["predicted_bytes"] / message_bytes, mode="markers", showlegend=rank == 0,
                        marker=dict(symbol="line-ew-open", size=14, color="black", line_width=2))
    fig.update_layout(title=title, barmode="group", scattermode="group", yaxis_title="bytes sent / M",
                      height=380)
    return fig


def comm_time_bars(df, title: str = "Time in each communication op, per rank") -> go.Figure:
    """Bars of total time per op, one bar per rank. `df`: rank, op, time_us (profiling.comm_table)."""
    fig = go.Figure()
    for rank, g in df.groupby("rank"):
        fig.add_bar(name=f"rank {rank}", x=g["op"], y=g["time_us"] / 1e3)
    fig.update_layout(title=title, barmode="group", yaxis_title="ms", height=360)
    return fig


def comm_volume_bars(df, psi_bytes: float, title: str = "Bytes moved per rank per step") -> go.Figure:
    """Stacked bars per strategy, one segment per collective, in units of Ψ (the model's bytes).
    `df` columns: strategy, op, volume (bytes per step, the ZeRO paper's factors applied)."""
    fig = go.Figure()
    for op, g in df.groupby("op", sort=False):
        fig.add_bar(name=str(op), x=g["strategy"], y=g["volume"] / psi_bytes)
    fig.update_layout(title=title, barmode="stack", yaxis_title="volume / Ψ", height=380)
    return fig
