"""Context parallelism: each rank holds a chunk of every sequence; K/V travel round a ring
(ring.py, Liu et al. 2023); the transform puts ring attention in every block (parallelize.py)."""
