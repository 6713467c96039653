"""The lab's tools for the pipeline (refimpl.parallel.pp): the table replayed with costs and checked
(simulate), NCCL's stream order replayed offline (nccl_order), the old posting that hung under it
(posting), and two demonstrations of notebook 07 (boundary, weight_stashing)."""
