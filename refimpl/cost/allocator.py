"""Memory beyond the model states (seed §1.1): workspace, and how a caching allocator fragments.

Workspace (워크스페이스 메모리) is scratch space libraries take for themselves, not tensors a model
owns: cuBLAS keeps a workspace per handle and stream (`CUBLAS_WORKSPACE_CONFIG=:4096:8` means
8 buffers of 4096 KiB), NCCL keeps staging buffers per channel and peer (`NCCL_BUFFSIZE`, 4 MiB by
default), and the CUDA context itself takes a few hundred MB before the first tensor.

Fragmentation: PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) never returns
memory to the driver between steps; it rounds each request and carves it out of cached segments:

* a request is rounded up to a multiple of 512 bytes (kMinBlockSize);
* requests up to 1 MiB (kSmallSize) come from 2 MiB segments (kSmallBuffer) of a "small" pool;
* requests up to 10 MiB (kMinLargeAlloc) get a 20 MiB segment (kLargeBuffer) of the "large" pool;
  larger ones a segment rounded up to 2 MiB (kRoundLarge).

A block split off a segment can only be reused by a request that fits in it, so a freed 15 MiB
hole in a 20 MiB segment cannot take a 16 MiB tensor: `reserved - allocated` grows. The GPU check
measures it (`torch.cuda.memory_stats()`: "reserved_bytes" vs "allocated_bytes");
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` lets segments grow in place to reduce it.
These figures are the allocator's constants, read from its source; they are not measured here.
"""
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

