"""Memory beyond the model states (seed §1.1): workspace, and how a caching allocator fragments."""
from __future__ import annotations

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20

# Scratch space of the libraries, per GPU process (sources in the module docstring).
WORKSPACE_BYTES = {
    "cuBLAS workspace (:4096:8)": 8 * 4096 * 1024,
    "NCCL buffers, 1 channel x 1 peer (NCCL_BUFFSIZE)": 4 << 20,
}


def block_bytes(request: int) -> int:
    """What the allocator hands out for a request of `request` bytes (a multiple of 512)."""
    return max(MIN_BLOCK, -(-request // MIN_BLOCK) * MIN_BLOCK)


def segment_bytes(request: int) -> int:
    """The size of a fresh segment cudaMalloc'd for this request when no cached block fits."""
    size = block_bytes(request)
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE

