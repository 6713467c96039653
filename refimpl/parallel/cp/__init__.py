"""Context parallelism: each rank holds a chunk of every sequence; K/V travel round a ring.

    ring.py          ring attention (Liu et al. 2023) with the load-balanced chunk order
    parallelize.py   the transform: ring attention in every block, the batch's sequence chunks
"""
