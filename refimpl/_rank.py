"""Entry point of one rank started by `refimpl.launch.run` (python -m refimpl._rank).

Reads the cloudpickled function, joins the process group, runs it, and writes either the
cloudpickled result or the traceback where the parent looks for it. Kept apart from launch.py so
the child imports as little as possible before OMP_NUM_THREADS takes effect.
"""
import json
import os
import sys
import traceback
from pathlib import Path


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if the launching process dies (e.g. a killed notebook kernel)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
        if os.getppid() == 1:  # the parent died before we could ask
            os._exit(1)


def _keep_freed_memory() -> None:
    """Ask glibc to keep the memory a step frees for the next step instead of handing it back to
    the kernel. PyTorch's CPU tensors come straight from malloc (no caching allocator, unlike CUDA),
    and glibc by default unmaps a freed block of 128 KiB or more and trims the heap's free top, so
    the next step's tensors of that size land on fresh pages, each faulted in and zeroed by the
    kernel on the rank's main thread. Measured on a zbv step on 2 loaded CPU ranks: ~1,200 page
    faults per step in our pipeline runner (refimpl.parallel.pp), whose B frees a micro-batch's
    activations at once, and 13-15 % of its main-thread CPU time; 20-700 in PyTorch's, which keeps
    them until W. Now every block under 32 MiB (the most glibc allows) comes from the heap, which
    is trimmed only past 1 GiB free: a rank keeps its peak heap until it exits."""
    if sys.platform.startswith("linux"):
        import ctypes

        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
            libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        except (OSError, AttributeError):     # not glibc: its own policy stays
            pass


def main() -> None:
    _die_with_parent()
    _keep_freed_memory()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    outdir = Path(os.environ["REFIMPL_OUTDIR"])
    try:
        import cloudpickle

        payload = Path(os.environ["REFIMPL_PAYLOAD"])
        # The parent's sys.path first, so functions pickled by reference (e.g. from a test module
        # or a notebook's local package) import here exactly as they did there.
        for entry in reversed(json.loads(payload.with_suffix(".path.json").read_text())):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        job = cloudpickle.loads(payload.read_bytes())
        from refimpl.launch import init_process_group

        init_process_group(rank, world_size, os.environ["REFIMPL_BACKEND"],
                           float(os.environ["REFIMPL_TIMEOUT"]))
        audit = os.environ.get("REFIMPL_DEVICE_AUDIT")   # a test mode: refimpl/device_audit.py
        if audit:
            from refimpl.device_audit import FactoryAudit

            with FactoryAudit() as factories:
                result = job["fn"](rank, world_size, *job["args"], **job["kwargs"])
            factories.write(audit, rank)
        else:
            result = job["fn"](rank, world_size, *job["args"], **job["kwargs"])
        (outdir / f"result{rank}.pkl").write_bytes(cloudpickle.dumps(result))
        import gc

        import torch.distributed as dist

        gc.collect()    # drop reference cycles holding tensors/hooks while the group still exists
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        (outdir / f"error{rank}.txt").write_text(traceback.format_exc())
        _flush_and_exit(1)
    # The result is written: skip interpreter teardown, where C++ destructors of leftover
    # distributed objects have been seen to abort ("terminate called without an active exception").
    _flush_and_exit(0)


def _flush_and_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
