"""How a collective is issued: inside the seam's span, on this thread. `async_op=True` returns a
Work; a lane registered under the entry-point group "refimpl.comm_lane" (the lab's worker thread)
runs it beside the caller, and without one it is done before the Work comes back."""
from __future__ import annotations

from concurrent.futures import Future
from functools import cache

from refimpl.comm.p2p import GroupView
from refimpl.seam import plugins, span


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


class InOrder:
    """Each collective run at once, on the caller's thread: an asynchronous one is finished when
    its Work is handed back."""

    def submit(self, task, group=None) -> Work:
        done = Future()
        done.set_result(task())
        return Work(done)

    def drain(self) -> None:
        """Nothing is left running."""


@cache
def lane():
    found = plugins("refimpl.comm_lane")
    return found[0]() if found else InOrder()


def issue(name: str, group, async_op: bool, body, nbytes: int | None = None):
    """Run `body(GroupView)` as collective `name`: now, or on the lane when `async_op`."""
    g = GroupView.of(group)
    if not g.member:
        return None

    def task():
        with span(name, nbytes, group):
            body(g)

    if async_op:
        return lane().submit(task, group)
    lane().drain()     # a blocking call comes after every asynchronous one issued before it
    task()
    return None
