"""Count the bytes each rank puts on the wire, per collective.

    with CommCounter() as counted:
        comm.all_reduce(x)
    counted.sent["all_reduce"]      # bytes this rank sent: 2(n-1)/n * x.nbytes for the ring

Why a counter and not a formula: the cost tables in the seed (section 2.2) and in Patarasuk & Yuan
2009 are statements about bytes per rank; counting them on a live run turns the statement into
something a notebook can assert. Every send in `refimpl.comm` goes through `record_send`, so the
count is exact, including the uneven chunks of a tensor whose size does not divide by the world
size.

The active counters live in a `contextvars.ContextVar`, not in a module global: each thread and
each asynchronous collective (which copies the caller's context when it is issued) sees the
counters that were open where it was called, and nothing leaks between unrelated code.
"""
from __future__ import annotations

import contextvars
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

# Counters open in this context (innermost last), and the collective that is running.
_COUNTERS: contextvars.ContextVar[tuple] = contextvars.ContextVar("refimpl_comm_counters", default=())
_OP: contextvars.ContextVar[str] = contextvars.ContextVar("refimpl_comm_op", default="send")


@dataclass
class CommCounter:
    """Bytes and messages this rank sent and received, keyed by collective name."""

    sent: dict = field(default_factory=lambda: defaultdict(int))
    received: dict = field(default_factory=lambda: defaultdict(int))
    messages: dict = field(default_factory=lambda: defaultdict(int))

    def __enter__(self) -> "CommCounter":
        self._token = _COUNTERS.set(_COUNTERS.get() + (self,))
        return self

    def __exit__(self, *exc) -> None:
        _COUNTERS.reset(self._token)


def record_send(nbytes: int) -> None:
    op = _OP.get()
    for counter in _COUNTERS.get():
        counter.sent[op] += nbytes
        counter.messages[op] += 1


def record_recv(nbytes: int) -> None:
    op = _OP.get()
    for counter in _COUNTERS.get():
        counter.received[op] += nbytes


@contextmanager
def op_scope(name: str):
    """Attribute every send inside this block to collective `name`."""
    token = _OP.set(name)
    try:
        yield
    finally:
        _OP.reset(token)
