"""Fragmentation (seed 001, 메모리 단편화), replayed: a real step's allocations through CUDA's rules.

refimpl.lab.measure.allocator holds the constants of PyTorch's CUDA caching allocator
(c10/cuda/CUDACachingAllocator.cpp); this module runs them. `CachingAllocator` follows the
allocator's decisions for one stream, with its default configuration:

  round     every request becomes a block of a multiple of 512 bytes (allocator.block_bytes);
  pool      blocks up to 1 MiB live in the small pool, larger ones in the large pool; a block of
            one pool never serves the other;
  best fit  a request takes the smallest cached free block of its pool that holds it (ties: the
            lowest address), else a fresh segment is reserved (allocator.segment_bytes);
  split     the rest of that block stays cached as a free block when it is big enough to be
            useful: >= 512 B in the small pool, > 1 MiB in the large pool (else the request
            keeps the whole block, and the slack counts as allocated-but-unused);
  free      a freed block merges with its free neighbours in the same segment; segments are
            never given back to the driver (until empty_cache or an out-of-memory retry, which
            a steady training loop does not reach).

Fragmentation is then the peak reserve minus the peak of what the blocks held: memory the GPU set
aside that no tensor ever used at the same time, because the holes between live blocks were too
small, or of the wrong pool, for the requests that came. `replay` feeds it the allocation stream of a
real step: the `[memory]` events the profiler records on this machine's allocator
(profile_memory=True; refimpl.lab.trace.memory_events), each with its address and size, in order.
The CPU allocator that recorded them does not cache (it hands large buffers back to the system at
once), so the CPU figures are what *this* sequence of tensors would cost under CUDA's rules; on a
GPU, torch.cuda.memory_stats()'s "reserved_bytes.all.peak" is the allocator's own count of it.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from refimpl.lab.measure.allocator import MIN_BLOCK, SMALL_SIZE, block_bytes, segment_bytes
from refimpl.lab.trace.native_stderr import quiet_profiler_in_notebook
from refimpl.lab.trace.profiling import read_trace
from refimpl.model import build_model, lm_loss, synthetic_batch


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


@dataclass
class _Segment:
    size: int
    small: bool
    blocks: list = field(default_factory=list)     # _Block in address order


class CachingAllocator:
    """One stream's caching allocator: malloc(key, nbytes) / free(key); counters in bytes."""

    def __init__(self):
        self.segments: list[_Segment] = []
        self.live: dict = {}                 # key -> its _Block
        self.requested = 0                   # bytes the tensors asked for
        self.allocated = 0                   # bytes of the blocks they hold (rounded, unsplit rest)
        self.reserved = 0                    # bytes of all segments
        self.peak_requested = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, key, nbytes: int) -> None:
        size = block_bytes(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small) or self._new_segment(size, small)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            seg = self.segments[block.segment]
            tail = _Block(block.segment, block.offset + size, rest)
            seg.blocks.insert(seg.blocks.index(block) + 1, tail)
            block.size = size
        block.free = False
        self.live[key] = (block, nbytes)
        self.requested += nbytes
        self.allocated += block.size
        self.peak_requested = max(self.peak_requested, self.requested)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = self.reserved           # segments are never given back

    def free(self, key) -> None:
        block, nbytes = self.live.pop(key)
        self.requested -= nbytes
        self.allocated -= block.size
        block.free = True
        blocks = self.segments[block.segment].blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:           # merge with the next hole
            block.size += blocks.pop(i + 1).size
        if i > 0 and blocks[i - 1].free:                         # and with the previous one
            blocks[i - 1].size += blocks.pop(i).size

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        fits = [(b.size, b.segment, b.offset, b) for seg in self.segments if seg.small == small
                for b in seg.blocks if b.free and b.size >= size]
        return min(fits, key=lambda f: f[:3])[3] if fits else None

    def _new_segment(self, size: int, small: bool) -> _Block:
        seg = _Segment(segment_bytes(size), small)
        block = _Block(len(self.segments), 0, seg.size)
        seg.blocks.append(block)
        self.segments.append(seg)
        self.reserved += seg.size
        return block

    def summary(self) -> dict:
        """The peaks of what tensors asked for, of the blocks they held, and of the reserve.
        `fragmentation` is max reserved - max allocated (torch.cuda's max_memory_reserved -
        max_memory_allocated): set aside beyond the most the blocks ever held at once."""
        return {"peak_requested": self.peak_requested, "peak_allocated": self.peak_allocated,
                "peak_reserved": self.peak_reserved,
                "fragmentation": self.peak_reserved - self.peak_allocated,
                "segments": len(self.segments)}


def allocation_stream(trace: Path, window: tuple[float, float] | None = None) -> list[tuple[int, int]]:
    """(address, bytes) of every CPU allocator event in a chrome trace, in time order: bytes > 0
    allocates at that address, < 0 frees it. Optionally only those inside (start, end)."""
    events = read_trace(trace).get("traceEvents", [])
    stream = sorted((ev["ts"], ev["args"]["Addr"], ev["args"]["Bytes"]) for ev in events
                    if ev.get("name") == "[memory]" and ev.get("args", {}).get("Device Type") == 0)
    if window is not None:
        stream = [s for s in stream if window[0] <= s[0] < window[1]]
    return [(addr, nbytes) for _, addr, nbytes in stream]


def replay(stream) -> dict:
    """Run an allocation stream through CachingAllocator. A free of an address the stream never
    allocated (a tensor made before the recording began) is skipped; so is a zero-byte event."""
    alloc = CachingAllocator()
    for addr, nbytes in stream:
        if nbytes > 0:
            if addr in alloc.live:          # the recorder missed this address's free: drop it
                alloc.free(addr)
            alloc.malloc(addr, nbytes)
        elif nbytes < 0 and addr in alloc.live:
            alloc.free(addr)
    return alloc.summary()


def one_step_stream(model_cfg, global_batch: int = 8, seq_len: int | None = None, seed: int = 0,
                    steps: int = 2) -> list[tuple[int, int]]:
    """The allocation stream of the last of `steps` single-process training steps (forward,
    backward, AdamW) of the reference GPT on the CPU, recorded by the profiler's allocator events.
    The first step creates Adam's moments, which stay: the last one is the steady state."""
    model = build_model(model_cfg, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seq_len = seq_len or model_cfg.seq_len
    # in a Jupyter kernel, kineto's start/stop lines on fd 2 would show as red stderr blocks
    with (quiet_profiler_in_notebook(),
          profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof):
        for step in range(steps):
            with record_function("step"):
                b = synthetic_batch(model_cfg, global_batch, seq_len, seed, step)
                lm_loss(model(b.inputs), b.targets).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = read_trace(Path(path))["traceEvents"]
        last = max((ev for ev in events if ev.get("name") == "step" and ev.get("ph") == "X"),
                   key=lambda ev: ev["ts"])
        return allocation_stream(Path(path), (last["ts"], last["ts"] + last["dur"]))
    finally:
        os.unlink(path)
