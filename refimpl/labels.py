"""Labels: the names the code under test gives its phases and communication calls.

`phase("forward" | "backward" | "optimizer")` around each phase of a step, `comm_span(op, nbytes)`
around every collective (a `comm:<op> <n>B` range, the bytes in the name so the loader builds a
bandwidth table). Both are plain `record_function` ranges: free when no profiler is running. This
module is the bottom of the package's layers (the model's MoE layer labels its phases too); it
imports torch's profiler only when a label is made.

One convention for the bytes, everywhere: the whole message the collective is about -- the tensor
all-reduced or broadcast, the gathered output of an all-gather, the full input of a
reduce-scatter, one rank's buffer of an all-to-all (refimpl.cost.collective_bytes turns that into
what a rank sends).

`CommLog` is the one record of communication a test or a notebook opens: every labelled call
(`comm_span`) and every byte refimpl.comm's own collectives sent and received while it was open.
Where the rank's flight recorder is on (refimpl/flight_recorder.py), each labelled call is also
entered there with its group, peer, tag and the innermost phase, so a hang can be located.
"""
from __future__ import annotations

import contextvars
import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

from refimpl import flight_recorder

PHASES = ("forward", "backward", "optimizer")
COMM_LABEL = re.compile(r"^comm:(?P<op>[\w\-]+)(?: (?P<bytes>\d+)B)?$")


# The innermost phase label, for the flight recorder (set only while it is on).
_PHASE: contextvars.ContextVar[str | None] = contextvars.ContextVar("refimpl_phase", default=None)


def phase(name: str):
    """Label a phase of a step (forward, backward, optimizer, or any compute you name)."""
    from torch.profiler import record_function

    if not flight_recorder.active():
        return record_function(name)
    return _with_phase(record_function(name), name)


@contextmanager
def _with_phase(span, name: str):
    token = _PHASE.set(name)
    try:
        with span:
            yield
    finally:
        _PHASE.reset(token)


# The logs open in this context, innermost last. A ContextVar, not a module global: each thread and
# each asynchronous collective (which copies its caller's context) sees the logs open where it was
# called, and nothing leaks between unrelated code.
_OPEN_LOGS: contextvars.ContextVar[tuple] = contextvars.ContextVar("refimpl_comm_logs", default=())


@dataclass
class CommLog:
    """What this rank communicated while the log was open, two views of it:

    calls                        every labelled call: {op, pass, bytes (the message), world}
    sent, received, messages     bytes refimpl.comm's collectives put on and took off the wire, and
                                 the messages sent, per collective (refimpl.comm.counter counts each
                                 send: exact, uneven chunks included)
    """
    calls: list = field(default_factory=list)
    sent: dict = field(default_factory=lambda: defaultdict(int))
    received: dict = field(default_factory=lambda: defaultdict(int))
    messages: dict = field(default_factory=lambda: defaultdict(int))

    def __enter__(self) -> "CommLog":
        self._token = _OPEN_LOGS.set(_OPEN_LOGS.get() + (self,))
        return self

    def __exit__(self, *exc) -> None:
        _OPEN_LOGS.reset(self._token)

    def select(self, op: str | None = None, pass_: str | None = None) -> list[dict]:
        return [c for c in self.calls
                if (op is None or c["op"] == op) and (pass_ is None or c["pass"] == pass_)]

    def count(self, op: str | None = None, pass_: str | None = None) -> int:
        return len(self.select(op, pass_))

    def message_bytes(self, op: str | None = None, pass_: str | None = None) -> int:
        return sum(c["bytes"] for c in self.select(op, pass_))


def open_logs() -> tuple:
    """The logs open here. Code whose backward may run on another thread (autograd's device
    threads on GPU) keeps the tuple its forward saw and hands it to `comm_span(logs=...)`."""
    return _OPEN_LOGS.get()


def comm_span(op: str, nbytes: int | None = None, *, world: int | None = None,
              pass_: str | None = None, logs: tuple | None = None, group=None,
              peer: int | None = None, tag: int | None = None, phase: str | None = None):
    """Label one communication call of `nbytes` (the message: see the module docstring) over
    `world` ranks, and record it in the open logs (or in `logs`); `pass_` says forward/backward
    where the caller knows it. Bytes in the label let the loader build a bandwidth table.
    `group` (a ProcessGroup; None: the world), `peer` (a global rank) and `tag` are for the
    flight recorder: what a hang report names, with `phase` (default: the innermost phase label)."""
    from torch.profiler import record_function

    if nbytes is not None:
        call = {"op": op, "pass": pass_, "bytes": int(nbytes), "world": world}
        for log in open_logs() if logs is None else logs:
            log.calls.append(call)
    span = record_function(f"comm:{op}" + (f" {int(nbytes)}B" if nbytes is not None else ""))
    if not flight_recorder.active():
        return span
    return flight_recorder.entered(op, None if nbytes is None else int(nbytes), group, peer, tag,
                                   phase or _PHASE.get(), inner=span)


def categorize(name: str) -> str:
    """forward / backward / optimizer / comm / step / op, from a range's name."""
    if name in PHASES:
        return name
    if COMM_LABEL.match(name) or name.startswith(("gloo:", "nccl:", "c10d::", "record_param_comms")):
        return "comm"
    if name.startswith("ProfilerStep#"):
        return "step"
    return "op"
