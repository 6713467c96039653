"""Plotly figures for the notebooks: timelines, memory bars, bandwidth curves, schedules.

Each function takes DataFrames produced by refimpl and returns a go.Figure; no computation here.
The figures are grouped by what they draw: `timelines` (traces, pipeline schedules, time
splits), `memory` (what a rank holds), `comm` (what collectives move), `cost` (sweeps and models
against measurement), `placement` (the rank grid, work per rank or expert); `style` holds the
renderer setting (made on import: figures render offline in JupyterLab and in an nbconvert HTML
export) and the phase palette. Every name is re-exported here, so callers write
`from refimpl import plots` and then `plots.rank_timeline(...)`.
"""
from __future__ import annotations

from refimpl.lab.plots.comm import bytes_sent_bars, comm_time_bars, comm_volume_bars, reach_heatmaps
from refimpl.lab.plots.cost import bandwidth_curves, fit_vs_measured, line_chart, predicted_vs_measured
from refimpl.lab.plots.memory import MODEL_STATE_COLORS, memory_bars, model_state_stacks
from refimpl.lab.plots.placement import AXIS_COLORS, cp_work_bars, load_heatmap, mesh_figure
from refimpl.lab.plots.style import PHASE_COLORS
from refimpl.lab.plots.timelines import pipeline_gantt, rank_timeline, time_split_bars

__all__ = [
    "AXIS_COLORS", "MODEL_STATE_COLORS", "PHASE_COLORS",
    "bandwidth_curves", "bytes_sent_bars", "comm_time_bars", "comm_volume_bars", "cp_work_bars",
    "fit_vs_measured", "line_chart", "load_heatmap", "memory_bars", "mesh_figure",
    "model_state_stacks", "pipeline_gantt", "predicted_vs_measured", "rank_timeline",
    "reach_heatmaps", "time_split_bars",
]
