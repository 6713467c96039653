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
    "gpu": "#72B7B2", "gpu_comm": "#B279A2",     # kernels on a GPU's streams (CUDA runs)
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


def rank_timeline(df, title: str = "Per-rank timeline", max_events: int = 4000,
                  colors: dict | None = None) -> go.Figure:
    """One lane per rank; each labelled range a horizontal bar coloured by its category.

    `df` is refimpl.trace.profiling.load_trace(...); ranges are drawn on a shared time axis (ms).
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


# --- communication (notebooks 01 and 02) ---------------------------------------------------------

def reach_heatmaps(reach: dict, title: str = "Whose data reaches whom") -> go.Figure:
    """One small heatmap per primitive: cell (k, j) lit when rank k's input reached rank j.

    `reach` maps a primitive's name to its n x n 0/1 matrix (refimpl.comm.primitives.dependency).
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

    `df` is refimpl.comm.traffic.traffic_table(...): collective, rank, sent / M, predicted_bytes.
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


def bandwidth_curves(df, ceiling_bytes_per_s: float | None = None, y: str = "busbw",
                     title: str = "Bus bandwidth vs message size", log_y: bool = True) -> go.Figure:
    """busbw (or algbw) against message size, one line per (op, impl); refimpl dashed.

    `df` is refimpl.bench.sweep(...) for one world size; the ceiling is drawn as a red line.
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

    `df` is refimpl.bench.with_predictions(...) restricted to one impl and world size.
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


def comm_time_bars(df, title: str = "Time in each communication op, per rank") -> go.Figure:
    """Bars of total time per op, one bar per rank. `df`: rank, op, time_us (profiling.comm_table)."""
    fig = go.Figure()
    for rank, g in df.groupby("rank"):
        fig.add_bar(name=f"rank {rank}", x=g["op"], y=g["time_us"] / 1e3)
    fig.update_layout(title=title, barmode="group", yaxis_title="ms", height=360)
    return fig


# --- data parallelism (notebook 03) ---------------------------------------------------------------

def time_split_bars(summary, title: str = "Where a step's time goes") -> go.Figure:
    """Stacked bars per (strategy, rank): compute only, comm hidden under compute, comm only, idle.

    `summary` is refimpl.trace.profiling.summarize(...) for several runs, concatenated with a
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


# --- ZeRO and FSDP (notebooks 04, 05) -------------------------------------------------------------

MODEL_STATE_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B",
                      "gathered (transient)": "#B279A2", "activations": "#BAB0AC"}


def model_state_stacks(df, title: str = "Model states per rank") -> go.Figure:
    """Stacked bars, one per (group, source), stacked by category; e.g. predicted vs measured per
    ZeRO stage. `df` columns: group, source, category, bytes."""
    fig = go.Figure()
    for category, g in df.groupby("category", sort=False):
        fig.add_bar(name=str(category), x=[g["group"].astype(str), g["source"].astype(str)],
                    y=g["bytes"] / 2**20, marker_color=MODEL_STATE_COLORS.get(category))
    fig.update_layout(title=title, barmode="stack", yaxis_title="MiB per rank", height=420)
    return fig


def comm_volume_bars(df, psi_bytes: float, title: str = "Bytes moved per rank per step") -> go.Figure:
    """Stacked bars per strategy, one segment per collective, in units of Ψ (the model's bytes).
    `df` columns: strategy, op, volume (bytes per step, the ZeRO paper's factors applied)."""
    fig = go.Figure()
    for op, g in df.groupby("op", sort=False):
        fig.add_bar(name=str(op), x=g["strategy"], y=g["volume"] / psi_bytes)
    fig.update_layout(title=title, barmode="stack", yaxis_title="volume / Ψ", height=380)
    return fig


PLAN_PARTS = {"compute_s": "compute", "tp_comm_s": "tp comm", "cp_comm_s": "cp ring",
              "pp_comm_s": "pp sends", "bubble_s": "pipeline bubble", "dp_comm_s": "dp sync",
              "optimizer_s": "optimizer"}


def plan_breakdown(df, top: int = 12, title: str = "Predicted step time of the best layouts") -> go.Figure:
    """Stacked horizontal bars, one per layout of refimpl.plan.plan's table (fastest at the top),
    split into the terms of the prediction; memory per GPU in the hover text."""
    rows = df.head(top).iloc[::-1]
    labels = [f"dp{r.dp} tp{r.tp} pp{r.pp} cp{r.cp} z{r.zero_stage} b{r.micro_batch_size} "
              f"{r.recompute}{' sp' if r.sequence_parallel else ''}" for r in rows.itertuples()]
    fig = go.Figure()
    for column, name in PLAN_PARTS.items():
        fig.add_bar(name=name, y=labels, x=rows[column], orientation="h",
                    customdata=rows["memory_bytes"] / 1e9,
                    hovertemplate="%{x:.3g} s<br>memory %{customdata:.1f} GB<extra>" + name + "</extra>")
    fig.update_layout(title=title, barmode="stack", xaxis_title="seconds per step",
                      height=120 + 28 * len(rows))
    return fig


def plan_scatter(df, title: str = "Every layout: memory per GPU vs predicted step time",
                 capacity_bytes: float | None = None) -> go.Figure:
    """One point per layout; colour says whether it fits; a line at the GPU's capacity."""
    fig = go.Figure()
    for fits, g in df.groupby("fits"):
        fig.add_scatter(x=g["memory_bytes"] / 1e9, y=g["step_time_s"], mode="markers",
                        name="fits" if fits else "does not fit", marker={"size": 5},
                        text=[f"dp{r.dp} tp{r.tp} pp{r.pp} cp{r.cp} z{r.zero_stage} "
                              f"b{r.micro_batch_size} {r.recompute}" for r in g.itertuples()])
    if capacity_bytes:
        fig.add_vline(x=capacity_bytes / 1e9, line_dash="dash", annotation_text="capacity")
    fig.update_layout(title=title, xaxis_title="GB per GPU", yaxis_title="step time (s)",
                      yaxis_type="log", height=420)
    return fig


def predicted_vs_measured(df, title: str = "The planner on this machine: predicted vs measured"
                          ) -> go.Figure:
    """Two panels, one point per layout (refimpl.plan.cpu's table with measured columns): memory
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


def cp_work_bars(df, title: str = "Ring attention: score blocks each rank computes") -> go.Figure:
    """Grouped bars per rank, one bar per sequence layout (head-tail vs contiguous).
    `df` columns: rank, layout, score_blocks (refimpl.parallel.cp.score_blocks_per_rank)."""
    fig = go.Figure()
    for layout, g in df.groupby("layout", sort=False):
        fig.add_bar(name=str(layout), x=g["rank"].astype(str), y=g["score_blocks"])
    fig.update_layout(title=title, barmode="group", xaxis_title="cp rank",
                      yaxis_title="chunk x chunk score blocks", height=360)
    return fig


AXIS_COLORS = {"tp": "#E45756", "cp": "#B279A2", "pp": "#F58518", "dp": "#4C78A8",
               "ep": "#54A24B"}


def mesh_figure(grid_rows, title: str = "The rank grid") -> go.Figure:
    """Every rank as a box at (column = cp·tp index, row = dp·pp index); one line trace per axis
    joins the ranks of each group, so a reader sees which ranks talk over which axis (click an
    axis in the legend to hide it). `grid_rows` is refimpl.mesh.describe_grid(dims)."""
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


def pipeline_gantt(df, title: str = "Pipeline schedule") -> go.Figure:
    """One lane per pipeline rank; each action (F3, B3, W3, F3.1) a bar labelled with its name.

    `df` columns: rank, action, start, end (unit times from refimpl.parallel.pp_simulate, or ms
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


def load_heatmap(matrix, x_labels, y_labels, title: str = "Tokens per expert",
                 x_title: str = "step", y_title: str = "expert") -> go.Figure:
    """A heatmap of counts (rows: experts or ranks, columns: steps), e.g. MoE routing load."""
    fig = go.Figure(go.Heatmap(z=matrix, x=list(x_labels), y=[str(y) for y in y_labels],
                               colorscale="Viridis", colorbar_title="tokens"))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, height=320)
    return fig
