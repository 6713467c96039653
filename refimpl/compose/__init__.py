"""Composing the axes on one grid: the transforms in one fixed order and their layout checks
(transforms.py), ring attention over tensor-parallel heads (tp_cp.py)."""
