"""Where ranks sit and how evenly work spreads over them (notebooks 08, 09).

`mesh_figure` draws the rank grid with one line trace per parallelism axis joining each group's
ranks (coloured by `AXIS_COLORS`); `cp_work_bars` the attention score blocks each context-parallel
rank computes under each sequence layout; and `load_heatmap` a count per (expert or rank, step),
e.g. how many tokens MoE routing sent to each expert.
"""
from __future__ import annotations

import plotly.graph_objects as go

from refimpl.mesh import AXES, ParallelDims

AXIS_COLORS = {"tp": "#E45756", "cp": "#B279A2", "pp": "#F58518", "dp": "#4C78A8",
               "ep": "#54A24B"}


def mesh_figure(grid_rows, title: str = "The rank grid") -> go.Figure:
    """Every rank as a box at (column = cp·tp index, row = dp·pp index); one line trace per axis
    joins the ranks of each group, so a reader sees which ranks talk over which axis (click an
    axis in the legend to hide it). `grid_rows` is describe_grid(dims), below."""
    rows = list(grid_rows)
    tp = max(r["tp"] for r in rows) + 1
    pp = max(r["pp"] for r in rows) + 1
    per_replica = max(r["dp"] for r in rows) + 1

    def position(r):
        return r["cp"] * tp + r["tp"], -((r["replica"] * per_replica + r["dp"]) * pp + r["pp"])

    where = {r["rank"]: position(r) for r in rows}
    fig = go.Figure()
    for axis, color in AXIS_COLORS.items():
        xs, ys, seen = [], [], set()
        for r in rows:
            group = tuple(r[f"{axis}_group"])
            if len(group) < 2 or group in seen:
                continue
            seen.add(group)
            for member in group:
                xs.append(where[member][0])
                ys.append(where[member][1])
            xs.append(None)
            ys.append(None)
        if xs:
            fig.add_scatter(x=xs, y=ys, mode="lines", name=f"{axis} groups",
                            line=dict(color=color, width=3), hoverinfo="skip")
    fig.add_scatter(x=[where[r["rank"]][0] for r in rows], y=[where[r["rank"]][1] for r in rows],
                    mode="markers+text", text=[str(r["rank"]) for r in rows], name="ranks",
                    marker=dict(size=34, color="white", line=dict(color="#333", width=2)),
                    hovertext=[f"rank {r['rank']}: dp {r['dp']} pp {r['pp']} cp {r['cp']} "
                               f"tp {r['tp']}" for r in rows], hoverinfo="text")
    fig.update_layout(title=title, height=120 + 70 * len({y for _, y in where.values()}),
                      xaxis=dict(visible=False), yaxis=dict(visible=False))
    return fig


def cp_work_bars(df, title: str = "Ring attention: score blocks each rank computes") -> go.Figure:
    """Grouped bars per rank, one bar per sequence layout (head-tail vs contiguous).
    `df` columns: rank, layout, score_blocks (refimpl.lab.measure.cp_measure.score_blocks_per_rank)."""
    fig = go.Figure()
    for layout, g in df.groupby("layout", sort=False):
        fig.add_bar(name=str(layout), x=g["rank"].astype(str), y=g["score_blocks"])
    fig.update_layout(title=title, barmode="group", xaxis_title="cp rank",
                      yaxis_title="chunk x chunk score blocks", height=360)
    return fig


def load_heatmap(matrix, x_labels, y_labels, title: str = "Tokens per expert",
                 x_title: str = "step", y_title: str = "expert") -> go.Figure:
    """A heatmap of counts (rows: experts or ranks, columns: steps), e.g. MoE routing load."""
    fig = go.Figure(go.Heatmap(z=matrix, x=list(x_labels), y=[str(y) for y in y_labels],
                               colorscale="Viridis", colorbar_title="tokens"))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, height=320)
    return fig


def describe_grid(dims: ParallelDims) -> list[dict]:
    """One row per rank: its coordinates and the ranks it talks to on each axis (for tables and
    the notebooks' grid figure)."""
    rows = []
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        row = {"rank": rank, **{a: coords[a] for a in ("replica",) + AXES}}
        for axis in ("dp", "pp", "cp", "tp", "ep"):
            row[f"{axis}_group"] = next(g for g in dims.groups(axis) if rank in g)
        rows.append(row)
    return rows


