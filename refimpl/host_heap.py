"""glibc's malloc policy for a rank process, set by refimpl._rank (our ranks) and refimpl.launch
(a rank torchrun started): on the host, every CPU tensor comes from malloc.
"""
import sys


def heap_policy() -> None:
    """How glibc's malloc, where every CPU tensor comes from (PyTorch keeps no cache of host
    memory, unlike CUDA's), treats what a rank frees; set once, before the rank allocates.

    Blocks under 1 MiB stay in the heap for the next step, trimmed only past 1 GiB free. glibc by
    default hands a freed block of 128 KiB or more back to the kernel, so the next step's landed
    on fresh pages, each faulted in and zeroed on the rank's main thread: on a zbv step on 2 loaded
    CPU ranks, ~1,200 page faults a step in our pipeline runner (refimpl.parallel.pp), whose B
    frees a micro-batch's activations at once, 13-15 % of its main-thread CPU time.

    Blocks of 1 MiB and more are mapped on their own and unmapped when freed. Kept in the heap
    (as they were, up to 32 MiB, and as glibc's default ends up keeping them: its threshold rises
    to the largest block freed), they pinned the rank's peak for good: a freed block is reused
    only by a request it can hold, and smaller ones split it first, so each unit ZeRO-3 gathered
    left its hole and the heap grew by about the whole model in a step (issue 52: 8 ranks of a
    51 M-parameter model, 300-500 MiB beyond the 97 MiB of the shard's states; measured with
    scripts/resident_memory.py). Now a gathered unit costs its pages' faults each time it comes."""
    if sys.platform.startswith("linux"):
        import ctypes

        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
            libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        except (OSError, AttributeError):     # not glibc: its own policy stays
            pass
