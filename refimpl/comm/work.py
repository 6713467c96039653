"""How a collective is issued: now, on this thread, inside the seam's span. `async_op=True` hands
back a Work that is already complete, as torch's would be once waited on (the lab runs refimpl.comm's
asynchronous collectives beside the caller: refimpl.lab.runtime.lane)."""
from __future__ import annotations

from concurrent.futures import Future

from refimpl.comm.p2p import GroupView
from refimpl.seam import span


class Work:
    """The handle an asynchronous collective returns, shaped like torch.distributed's Work."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Future:
        done = Future()
        done.set_result(None)
        return done


def issue(name: str, group, async_op: bool, body, nbytes: int | None = None):
    """Run `body(GroupView)` as collective `name`; a Work when `async_op`, else None."""
    g = GroupView.of(group)
    if not g.member:
        return None
    with span(name, nbytes, group):
        body(g)
    return Work() if async_op else None
