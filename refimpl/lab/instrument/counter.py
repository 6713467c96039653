"""Count the bytes each rank puts on the wire, per collective, into the open CommLogs.

    with CommLog() as counted:                     # refimpl.lab.instrument.labels.CommLog
        comm.all_reduce(x)
    counted.sent["all_reduce"]      # bytes this rank sent: 2(n-1)/n * x.nbytes for the ring

Why a count and not a formula: the cost tables in the seed (section 2.2) and in Patarasuk & Yuan
2009 are statements about bytes per rank; counting them on a live run turns the statement into
something a notebook can assert. Every send in `refimpl.comm` goes through `record_send`, so the
count is exact, including the uneven chunks of a tensor whose size does not divide by the world
size. `op_scope` names the collective the sends belong to (a ContextVar, like the open logs).
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager

from refimpl.lab.instrument.labels import open_logs

# The collective that is running: its sends are counted under its name.
_OP: contextvars.ContextVar[str] = contextvars.ContextVar("refimpl_comm_op", default="send")


def record_send(nbytes: int) -> None:
    op = _OP.get()
    for log in open_logs():
        log.sent[op] += nbytes
        log.messages[op] += 1


def record_recv(nbytes: int) -> None:
    op = _OP.get()
    for log in open_logs():
        log.received[op] += nbytes


@contextmanager
def op_scope(name: str):
    """Attribute every send inside this block to collective `name`."""
    token = _OP.set(name)
    try:
        yield
    finally:
        _OP.reset(token)
