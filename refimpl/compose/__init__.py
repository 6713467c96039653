"""Composing the axes on one grid.

    transforms.py       the transforms in one fixed order, and their layout checks before launch
    tp_cp.py            ring attention over tensor-parallel heads (tp x cp)
    optim_reshard.py    optimizer state (AdamW's m, v) gathered to reference names and re-placed
"""
