"""The fastest any collective could move bytes on this machine, per device, and sweep sizes that
reach it.

A collective's bus bandwidth (busbw, refimpl.lab.measure.bench) is compared with a physical ceiling, and
the ceiling depends on where the ranks are:

* gloo (CPU ranks): two processes on one host talk through the kernel, which copies every byte at
  least once, so no collective beats one core's memcpy (ranks have one thread each);
* NCCL, one GPU per rank: every byte a collective sends is first read from the GPU's memory, so the
  device-to-device copy is the bound no busbw beats. The link itself (NVLink or PCIe) is measured
  by the peer copy (GPU i -> GPU j, `copy_` between devices), shown beside it; it is not a strict
  bound (NCCL drives several links at once; NVLink SHARP reduces inside the switch).

Every bandwidth here counts the bytes copied once (M / t), as busbw counts bytes carried; a
device copy also reads M bytes, so HBM traffic is 2M / t (what `nvidia-smi`-style "copy
bandwidth" figures often quote).

Sweep sizes: a link reaches its plateau only for large messages. On CPU/gloo a few MB already show
the shape; on GPUs nccl-tests sweeps to 8 GB (-e 8G). `max_message_bytes(backend)` is the knob's
default per backend, capped by the device's free memory.
"""
from __future__ import annotations

import statistics
import time

import pandas as pd
import torch

from refimpl.launch import pick_backend

# Largest message of a sweep per backend: CPU ranks on shared cores (a notebook's 2 minutes) vs GPUs
# (where links need >= 100s of MB to approach their plateau; nccl-tests goes to 8 GB).
DEFAULT_MAX_BYTES = {"gloo": 4 << 20, "nccl": 1 << 30}


def max_message_bytes(backend: str, free_fraction: float = 0.125) -> int:
    """The sweep's default largest message for `backend`; on GPU at most `free_fraction` of the
    free memory of device 0 (an all-gather holds input + n-times output)."""
    size = DEFAULT_MAX_BYTES.get(backend, DEFAULT_MAX_BYTES["gloo"])
    if backend == "nccl" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(0)
        size = min(size, _pow2_floor(int(free * free_fraction)))
    return size


def _pow2_floor(n: int) -> int:
    return 1 << max(n, 1).bit_length() - 1


def memcpy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of one large copy on one CPU thread, the best of `repeats` after a warm-up.

    One thread because each CPU rank has one (OMP_NUM_THREADS=1): it is the fastest any single
    rank can move bytes, and loopback traffic is copied by the kernel at no more than this. The
    best, not the median: a ceiling is what the core can do, and on shared cores other load only
    ever makes a copy slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(max(1, nbytes // 4))
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return src.numel() * 4 / min(times)
    finally:
        torch.set_num_threads(threads)


def cuda_copy_bandwidth(nbytes: int = 1 << 30, src: int = 0, dst: int | None = None,
                        repeats: int = 10) -> float:
    """Bytes/s of a copy from GPU `src` to GPU `dst` (default: the same GPU), timed with CUDA events.

    Same GPU: a device-to-device copy, bounded by HBM (read + write). Two GPUs: a peer copy over
    NVLink or PCIe (whichever `nvidia-smi topo -m` shows between them). Median over `repeats`
    after one warm-up copy.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_copy_bandwidth needs a GPU; torch sees none")
    dst = src if dst is None else dst
    numel = max(1, nbytes // 4)
    a = torch.ones(numel, device=f"cuda:{src}")
    b = torch.empty(numel, device=f"cuda:{dst}")
    b.copy_(a)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    with torch.cuda.device(src):
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)   # ms -> s
    del a, b
    torch.cuda.empty_cache()
    return numel * 4 / statistics.median(times)


def copy_sweep(device: str = "cpu", sizes=None, peer: bool = False, repeats: int = 5) -> pd.DataFrame:
    """Copy bandwidth vs size on `device` ("cpu" or "cuda"): where the copy reaches its plateau.

    `peer=True` (needs >= 2 GPUs) copies GPU 0 -> GPU 1. Columns: device, kind, size_bytes,
    bytes_per_s.
    """
    if sizes is None:
        top = 256 << 20 if device == "cpu" else max_message_bytes("nccl", free_fraction=0.25)
        sizes = [1 << k for k in range(12, top.bit_length(), 2)]
    if device == "cpu":
        kind, measure = "memcpy, one core", lambda n: memcpy_bandwidth(n, repeats)
    elif peer:
        if torch.cuda.device_count() < 2:
            raise RuntimeError("a peer copy needs >= 2 GPUs")
        kind, measure = "peer copy GPU0->GPU1", lambda n: cuda_copy_bandwidth(n, 0, 1, repeats)
    else:
        kind, measure = "device-to-device copy", lambda n: cuda_copy_bandwidth(n, 0, None, repeats)
    return pd.DataFrame([{"device": device, "kind": kind, "size_bytes": n,
                          "bytes_per_s": measure(n)} for n in sizes])


def ceiling_for(nproc: int, backend: str | None = None, nbytes: int | None = None) -> dict:
    """The ceiling a sweep of `nproc` ranks is compared with: {"backend", "kind", "bytes_per_s"},
    plus {"link_kind", "link_bytes_per_s"} for GPU ranks with >= 2 GPUs.

    gloo -> one core's memcpy (loopback traffic is copied by the kernel at no more than that).
    NCCL -> the GPU's device-to-device copy: every byte a collective sends is read from HBM, so no
    busbw beats the GPU's own copy. The peer copy (the GPU0 -> GPU1 link) is reported beside it
    but is not a bound: NCCL drives several links at once and NVLink SHARP reduces in the switch,
    so its busbw can exceed one copy engine's peer copy.
    """
    backend = backend or pick_backend(nproc)
    if backend != "nccl":
        return {"backend": backend, "kind": "memcpy, one CPU core",
                "bytes_per_s": memcpy_bandwidth(nbytes or 256 << 20)}
    nbytes = nbytes or max_message_bytes("nccl")
    out = {"backend": backend, "kind": "device-to-device copy",
           "bytes_per_s": cuda_copy_bandwidth(nbytes)}
    if torch.cuda.device_count() >= 2:
        out.update(link_kind="peer copy GPU0->GPU1",
                   link_bytes_per_s=cuda_copy_bandwidth(nbytes, 0, 1))
    return out
