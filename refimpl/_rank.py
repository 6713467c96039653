"""One rank started by `refimpl.launch.run` (python -m refimpl._rank): joins the process group, runs
the cloudpickled function, writes its result or its traceback where the parent looks. Apart from
launch.py so the child imports as little as possible before OMP_NUM_THREADS takes effect."""
import contextlib
import gc
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
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before we could ask
            os._exit(1)


def main() -> None:
    _die_with_parent()
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
        from refimpl.launch_tools import tools

        init_process_group(rank, world_size, os.environ["REFIMPL_BACKEND"],
                           float(os.environ["REFIMPL_TIMEOUT"]))
        with tools().running():        # e.g. the lab's device audit (refimpl.launch_tools)
            result = job["fn"](rank, world_size, *job["args"], **job["kwargs"])
        (outdir / f"result{rank}.pkl").write_bytes(cloudpickle.dumps(result))
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
