"""What a rank holds: memory per category, predicted against measured.

`memory_bars` groups one bar per source (e.g. predicted vs measured) under each memory category;
`model_state_stacks` stacks params, grads, optimizer state, transient gathers and activations
into one bar per (group, source), e.g. per ZeRO stage or FSDP setting, coloured by
`MODEL_STATE_COLORS` (notebooks 00, 03, 04, 05).
"""
from __future__ import annotations

import plotly.graph_objects as go

MODEL_STATE_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B",
                      "gathered (transient)": "#B279A2", "activations": "#BAB0AC"}


def memory_bars(df, title: str = "Memory per category") -> go.Figure:
    """Grouped bars: one group per category, one bar per source (e.g. predicted vs measured).

    `df` columns: category, source, bytes.
    """
    fig = go.Figure()
    for source, g in df.groupby("source", sort=False):
        fig.add_bar(name=str(source), x=g["category"], y=g["bytes"] / 2**20)
    fig.update_layout(title=title, barmode="group", yaxis_title="MiB", height=380)
    return fig


def model_state_stacks(df, title: str = "Model states per rank") -> go.Figure:
    """Stacked bars, one per (group, source), stacked by category; e.g. predicted vs measured per
    ZeRO stage. `df` columns: group, source, category, bytes."""
    fig = go.Figure()
    for category, g in df.groupby("category", sort=False):
        fig.add_bar(name=str(category), x=[g["group"].astype(str), g["source"].astype(str)],
                    y=g["bytes"] / 2**20, marker_color=MODEL_STATE_COLORS.get(category))
    fig.update_layout(title=title, barmode="stack", yaxis_title="MiB per rank", height=420)
    return fig
