"""Composing the axes on one grid: the transforms in one fixed order (transforms.py), ring
attention over tensor-parallel heads (tp_cp.py)."""
