"""A TensorBoard plugin of the workbook's own: every rank's trace on one time axis, offline.

Why not the profiler plugin? torch-tb-profiler reads our CPU/gloo traces, but its pages load
Google Charts and a polyfill from public CDNs, so without a network every view is a spinner; and
HolisticTraceAnalysis wants GPU kernels. This plugin draws a multi-rank CPU (or GPU) run with the
plotly.js that the plotly package ships, served by the plugin itself: no request leaves the machine.

It shows, for a run folder under the logdir (one `rank<r>.*.pt.trace.json` per rank):
  * a timeline: a lane per rank, spans coloured by phase and by collective, idle gaps visible;
  * compute / communication / overlap / idle per step and per rank (profiling.summarize);
  * the communication table: op, count, bytes, time, effective bandwidth (profiling.comm_table);
  * memory per rank by category, from the run_summary.json the training loop writes.

Registered through the `tensorboard_plugins` entry point in pyproject.toml, so `make tensorboard`
lists it beside Scalars once refimpl is installed.
"""
PLUGIN_NAME = "refimpl_timeline"
TAB_NAME = "Rank timeline"
