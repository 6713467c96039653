"""Labels: the names the lab gives a step's phases and communication calls (through refimpl.seam).

`phase("forward" | "backward" | "optimizer")` around each phase of a step, `comm_span(op, nbytes)`
around every collective (a `comm:<op> <n>B` range, the bytes in the name so the loader builds a
bandwidth table). Both are plain `record_function` ranges while a profiler runs, and nothing
otherwise. The mechanisms name neither: refimpl.lab.instrument.attach puts them on the seam.

One convention for the bytes, everywhere: the whole message the collective is about -- the tensor
all-reduced or broadcast, the gathered output of an all-gather, the full input of a
reduce-scatter, one rank's buffer of an all-to-all (refimpl.cost.collective_bytes turns that into
what a rank sends).

`CommLog` is the one record of communication a test or a notebook opens: every labelled call
(`comm_span`) and every byte refimpl.comm's own collectives sent and received while it was open.
Where the rank's flight recorder is on (refimpl/lab/runtime/flight_recorder.py), each labelled call is also
entered there with its group, peer, tag and the innermost phase, so a hang can be located.
"""
from __future__ import annotations

import contextvars
import re
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

from refimpl.lab.runtime import flight_recorder
from refimpl.seam import plain_phase

PHASES = ("forward", "backward", "optimizer")
COMM_LABEL = re.compile(r"^comm:(?P<op>[\w\-]+)(?: (?P<bytes>\d+)B)?$")


# The innermost phase label, for the flight recorder (set only while it is on).
_PHASE: contextvars.ContextVar[str | None] = contextvars.ContextVar("refimpl_phase", default=None)


class _ProcessWide:
    """What is open anywhere in this process (one rank), innermost last, for threads whose own
    context holds nothing: autograd runs backward on its own device thread on CUDA, which inherits
    no ContextVar from the thread that opened the phase and the logs, so without this a backward
    all-reduce would be counted nowhere and its phase be None (issue 35). A thread's own context
    wins where it has something (the caller's thread; an async collective, which copies its
    caller's context, refimpl.lab.runtime.lane)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: list = []

    def push(self, item) -> None:
        with self._lock:
            self._open.append(item)

    def pop(self, item) -> None:
        # by identity, not the last: two threads may close theirs in any order
        with self._lock:
            for i in range(len(self._open) - 1, -1, -1):
                if self._open[i] is item:
                    del self._open[i]
                    return

    def get(self) -> tuple:
        with self._lock:
            return tuple(self._open)


_PHASES_OPEN = _ProcessWide()   # [name] boxes, so equal names are still told apart on close
_LOGS_OPEN = _ProcessWide()


def current_phase() -> str | None:
    """The innermost phase open on this thread, else anywhere in this process (while the flight
    recorder is on: phases are tracked only then)."""
    here = _PHASE.get()
    if here is not None:
        return here
    anywhere = _PHASES_OPEN.get()
    return anywhere[-1][0] if anywhere else None


_range = plain_phase   # a profiler range while a profiler records (refimpl.seam says why)


# The innermost forward or backward open: the pass a collective belongs to (comm_span's `pass_`).
_PASS: contextvars.ContextVar[str | None] = contextvars.ContextVar("refimpl_pass", default=None)
_PASSES_OPEN = _ProcessWide()


def current_pass() -> str | None:
    """"forward" or "backward": the innermost of them open on this thread, else in this process
    (autograd's device thread on CUDA runs a backward opened on the main thread)."""
    here = _PASS.get()
    if here is not None:
        return here
    anywhere = _PASSES_OPEN.get()
    return anywhere[-1][0] if anywhere else None


def phase(name: str):
    """Label a phase of a step (forward, backward, optimizer, or any compute you name)."""
    if name in ("forward", "backward"):
        return _with_pass(_range(name) if not flight_recorder.active()
                          else _with_phase(_range(name), name), name)
    if not flight_recorder.active():
        return _range(name)
    return _with_phase(_range(name), name)


@contextmanager
def _opened(var: contextvars.ContextVar, everywhere: _ProcessWide, span, name: str):
    """`span` entered with `name` as `var`'s value on this thread and open in this process."""
    token, box = var.set(name), [name]
    everywhere.push(box)
    try:
        with span:
            yield
    finally:
        everywhere.pop(box)
        var.reset(token)


def _with_pass(span, name: str):
    return _opened(_PASS, _PASSES_OPEN, span, name)


def _with_phase(span, name: str):
    return _opened(_PHASE, _PHASES_OPEN, span, name)


# The logs open in this context, innermost last. A ContextVar first: each thread and each
# asynchronous collective (which copies its caller's context) sees the logs open where it was
# called. A thread whose context has none (autograd's device thread) sees those open anywhere in
# the process (_ProcessWide): a CommLog is what this rank communicated while it was open.
_OPEN_LOGS: contextvars.ContextVar[tuple] = contextvars.ContextVar("refimpl_comm_logs", default=())


@dataclass
class CommLog:
    """What this rank communicated while the log was open, two views of it:

    calls                        every labelled call: {op, pass, bytes (the message), world}
    sent, received, messages     bytes refimpl.comm's collectives put on and took off the wire, and
                                 the messages sent, per collective (refimpl.lab.instrument.counter counts each
                                 send: exact, uneven chunks included)
    """
    calls: list = field(default_factory=list)
    sent: dict = field(default_factory=lambda: defaultdict(int))
    received: dict = field(default_factory=lambda: defaultdict(int))
    messages: dict = field(default_factory=lambda: defaultdict(int))

    def __enter__(self) -> "CommLog":
        self._token = _OPEN_LOGS.set(_OPEN_LOGS.get() + (self,))
        _LOGS_OPEN.push(self)
        return self

    def __exit__(self, *exc) -> None:
        _LOGS_OPEN.pop(self)
        _OPEN_LOGS.reset(self._token)

    def select(self, op: str | None = None, pass_: str | None = None) -> list[dict]:
        return [c for c in self.calls
                if (op is None or c["op"] == op) and (pass_ is None or c["pass"] == pass_)]

    def count(self, op: str | None = None, pass_: str | None = None) -> int:
        return len(self.select(op, pass_))

    def message_bytes(self, op: str | None = None, pass_: str | None = None) -> int:
        return sum(c["bytes"] for c in self.select(op, pass_))


def open_logs() -> tuple:
    """The logs open in this thread's context, else those open anywhere in this process (the
    thread is autograd's device thread running a backward, or another helper thread of the rank).
    Code that knows the logs its forward saw may still hand them to `comm_span(logs=...)`."""
    return _OPEN_LOGS.get() or _LOGS_OPEN.get()


def comm_span(op: str, nbytes: int | None = None, *, world: int | None = None,
              pass_: str | None = None, logs: tuple | None = None, group=None,
              peer: int | None = None, tag: int | None = None, phase: str | None = None):
    """Label one communication call of `nbytes` (the message: see the module docstring) over
    `world` ranks, and record it in the open logs (or in `logs`); `pass_` says forward/backward
    where the caller knows it. Bytes in the label let the loader build a bandwidth table.
    `group` (a ProcessGroup; None: the world), `peer` (a global rank) and `tag` are for the
    flight recorder: what a hang report names, with `phase` (default: the innermost phase label)."""
    if nbytes is not None:
        call = {"op": op, "pass": pass_ or current_pass(), "bytes": int(nbytes), "world": world}
        for log in open_logs() if logs is None else logs:
            log.calls.append(call)
    span = _range(f"comm:{op}" + (f" {int(nbytes)}B" if nbytes is not None else ""))
    if not flight_recorder.active():
        return span
    return flight_recorder.entered(op, None if nbytes is None else int(nbytes), group, peer, tag,
                                   phase or current_phase(), inner=span)


# A backend's own range for a collective (gloo's on its worker thread, the staged backend's on the
# caller's): the collective in flight, where our comm:<op> labels time the caller inside the call.
BACKEND_RANGES = ("gloo:", "nccl:")


def categorize(name: str) -> str:
    """forward / backward / optimizer / comm / step / op, from a range's name."""
    if name in PHASES:
        return name
    if COMM_LABEL.match(name) or name.startswith(BACKEND_RANGES + ("c10d::", "record_param_comms")):
        return "comm"
    if name.startswith("ProfilerStep#"):
        return "step"
    return "op"
