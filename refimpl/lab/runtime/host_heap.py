"""glibc's malloc policy for a rank process, set as it joins its group (refimpl.lab.runtime.tools'
`joining`, for our ranks and for a rank torchrun started): every CPU tensor comes from malloc.
"""
import sys


def heap_policy() -> None:
    """How glibc's malloc, where every CPU tensor comes from, treats what a rank frees; set once,
    before the rank allocates. Blocks under 1 MiB stay in the heap for the next step (trimmed only
    past 1 GiB free): a step's small tensors do not land on fresh, zeroed pages. Blocks of 1 MiB
    and more are mapped on their own and unmapped when freed: kept in the heap, the holes each
    gathered ZeRO-3 unit left grew it by about the whole model (scripts/resident_memory.py)."""
    if sys.platform.startswith("linux"):
        import ctypes

        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
            libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        except (OSError, AttributeError):     # not glibc: its own policy stays
            pass
