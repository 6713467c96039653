"""How a collective is issued: labelled for the profiler, counted, and optionally asynchronous."""
from __future__ import annotations

import contextvars
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
import torch.distributed as dist

from refimpl.comm.p2p import GroupView
from refimpl.seam import span


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


def _caller_cuda_device() -> int | None:
    """The CUDA device the calling thread works on; None where this process has not initialised
    CUDA (no tensor is on a GPU then, and asking would create a context on GPU 0)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _use_cuda_device(index: int) -> None:
    torch.cuda.set_device(index)


class _Lane:
    """One FIFO worker thread, started on first use."""

    def __init__(self, caller_device=_caller_cuda_device, use_device=_use_cuda_device):
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self._caller_device, self._use_device = caller_device, use_device

    def submit(self, task) -> Work:
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


_LANE = _Lane()

LANE_ON_NCCL = ("refimpl.comm's asynchronous collectives run on gloo only: on NCCL their host "
                "thread would post on the default CUDA stream, in an order that can differ between "
                "ranks (a deadlock); use torch.distributed's collectives (--collectives torch)")


def issue(name: str, group, async_op: bool, body, nbytes: int | None = None):
    """Run `body(GroupView)` as collective `name`: now, or on the lane when `async_op`."""
    g = GroupView.of(group)
    if not g.member:
        return None

    def task():
        with span(name, nbytes, group):
            body(g)

    if async_op:
        if dist.get_backend(group) == "nccl":
            raise RuntimeError(LANE_ON_NCCL)
        return _LANE.submit(task)
    _LANE.drain()
    task()
    return None
