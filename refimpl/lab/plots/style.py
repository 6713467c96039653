"""What every figure shares: the renderer and the phase palette.

Importing this module (every figure module does) sets the renderer to `plotly_mimetype+notebook`:
it is the one setting whose figures render offline both in JupyterLab (trusted or not) and in an
nbconvert HTML export (the plotly.js bundle is embedded once per notebook). The default
`plotly_mimetype` leaves the HTML export empty, and the `*_connected` renderers fetch plotly.js
from a CDN. `PHASE_COLORS` gives each phase of a step one colour, used by every timeline (and by
the TensorBoard plugin) so a reader learns them once.
"""
from __future__ import annotations

import plotly.io as pio

pio.renderers.default = "plotly_mimetype+notebook"

PHASE_COLORS = {
    "forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B", "comm": "#E45756",
    "idle": "#DDDDDD",
    "gpu": "#72B7B2", "gpu_comm": "#B279A2",     # kernels on a GPU's streams (CUDA runs)
}
