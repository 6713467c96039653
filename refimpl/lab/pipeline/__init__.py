"""The lab's tools for the pipeline (refimpl.parallel.pp): the table replayed with costs and checked
(simulate), NCCL's stream order replayed offline (nccl_order), the old posting that hung under it
(posting), two demonstrations of notebook 07 (boundary, weight_stashing), the frontier schedules
the core's table takes as a plug-in (frontier: interleaved-zb, zbv, dualpipev), and the runner's
speed-ups the core's step takes as a plug-in (speedups)."""
