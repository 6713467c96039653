"""Tensor parallelism's variants beyond the syllabus, plugged into the core's tp layers.

    ring.py      SP's all-gather and reduce-scatter decomposed over the ring under the matmuls
    overlap.py   `--set tp_overlap=true`: the "refimpl.variants" plug-in that puts ring.py in place
"""
