"""The lane on which refimpl.comm's asynchronous collectives run (`--collectives refimpl`): one FIFO
worker thread per process. refimpl.comm itself runs every collective before it returns; `on_lane`
runs one with async_op=True here, beside the caller (the lab's seam plug-in does so for the
mechanisms: refimpl.lab.instrument.attach). docs/core_notes.md, "refimpl.comm.work, and the lane",
says why one thread, in order."""
from __future__ import annotations

import contextvars
import inspect
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import cache, partial

import torch
import torch.distributed as dist

from refimpl.mesh import LayoutError
from refimpl.process_group import launch_backend, pick_backend, under_torchrun

LANE_ON_NCCL = ("refimpl.comm's asynchronous collectives run on gloo only: on NCCL their host "
                "thread would post on the default CUDA stream, in an order that can differ between "
                "ranks (a deadlock); use torch.distributed's collectives (--collectives torch)")


def ranks_backend(cfg) -> str:
    """The backend cfg's ranks will run on, known before any of them starts: the one launch.run
    picks (under torchrun, for this node's ranks)."""
    ranks = cfg.nproc
    if under_torchrun():
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return pick_backend(ranks, launch_backend(cfg))


def refuse_on_nccl(cfg) -> None:
    """`--collectives refimpl` where the ranks would run on NCCL: refused in one line, before any
    rank starts (refimpl.lab.loop's layout checks), rather than by the lane once they run."""
    if cfg.collectives == "refimpl" and cfg.nproc > 1 and ranks_backend(cfg) == "nccl":
        raise LayoutError("--collectives refimpl runs on gloo only (--device cpu): on NCCL its "
                          "asynchronous lane would post from a second host thread on the default "
                          "CUDA stream, in an order that can differ between ranks (a deadlock)")


def _caller_cuda_device() -> int | None:
    """The CUDA device the calling thread works on; None where this process has not initialised
    CUDA (no tensor is on a GPU then, and asking would create a context on GPU 0)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _use_cuda_device(index: int) -> None:
    torch.cuda.set_device(index)


class Work:
    """The handle an asynchronous collective returns, shaped like torch.distributed's Work."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self, timeout=None) -> bool:
        """Block until done (timeout: seconds or a timedelta, as torch's Work.wait takes)."""
        if hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        self._future.result(timeout)  # re-raises whatever the collective raised
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> Future:
        return self._future


class Lane:
    """One FIFO worker thread, started on first use."""

    def __init__(self, caller_device=_caller_cuda_device, use_device=_use_cuda_device):
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self._caller_device, self._use_device = caller_device, use_device

    def submit(self, task, group=None) -> Work:
        """Run `task` after everything submitted before it; refused on an NCCL `group`."""
        if dist.is_initialized() and dist.get_backend(group) == "nccl":
            raise RuntimeError(LANE_ON_NCCL)
        ctx = contextvars.copy_context()  # the caller's open CommLogs follow the task
        device = self._caller_device()

        def run():
            if device is not None:
                self._use_device(device)
            return ctx.run(task)

        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm-lane")
            self._last = self._executor.submit(run)
            return Work(self._last)

    def drain(self) -> None:
        """Wait until everything issued so far has finished. A failure is not raised here but by
        its own handle's wait(), so it is reported once, where the caller asked for it."""
        last = self._last
        if last is not None:
            wait([last])


@cache
def lane() -> Lane:
    """This process's lane."""
    return Lane()


def on_lane(collective):
    """`collective` (one of refimpl.comm's, torch.distributed's signature) with async_op=True run on
    the lane: it returns the lane's Work at once. A blocking call comes after every asynchronous
    one issued before it, as on one stream."""
    signature = inspect.signature(collective)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if not bound.arguments.pop("async_op", False):
            lane().drain()
            return collective(*args, **kwargs)
        run = partial(collective, *bound.args, **bound.kwargs)   # blocking, on the lane's thread
        return lane().submit(run, bound.arguments.get("group"))

    call.__name__ = call.__qualname__ = collective.__name__
    return call
