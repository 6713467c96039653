"""One communicator's stream under NCCL's order, for the staged backend (refimpl.lab.runtime.shared_device).

gloo runs every posted send and receive on its own, so on gloo any posting order that waits only
for data finishes. NCCL does not (NVIDIA/nccl#479, #783): the operations a rank posts on a
communicator run one after another on its stream, in posting order, and a send may not complete
before the peer's matching receive has started (large messages have no eager buffer). A receive
posted early therefore holds back every later operation of the rank, and two ranks can each wait,
at the head of their streams, for an operation the other has queued behind its head: a hang that
gloo never shows (refimpl.lab.pipeline.nccl_order replays this offline for the pipeline's plans).

`Stream` makes a real run keep those rules: the staged group hands it every operation, and one
worker thread per group (one NCCL communicator, one stream) runs them strictly in posting order,
one unit at a time -- a unit does not start until the previous one has finished:

  * a unit is one isend or irecv, or one group of them (p2p.post's batch_isend_irecv, opened with
    StagedGloo.p2p_group as ncclGroupStart/End would): a group's operations start together, and
    the unit ends when all of them have;
  * a collective is a unit too: on NCCL it is stream-ordered with the communicator's point-to-point
    operations (the strictest reading: PyTorch may give single sends their own per-pair
    communicator, but with a bound device it reuses the group's), so it waits for the rank's
    earlier sends and receives on that group;
  * the rendezvous: a send completes only once the peer's receive has started. gloo's TCP
    transport already sends that way (the receiver announces a posted receive and only then does
    the sender transmit, whatever the size: a send with no receive posted stays incomplete, checked
    in tests/test_nccl_rules.py), and the peer posts its receive to gloo only when its own worker
    reaches it, i.e. when it starts on its stream. So the FIFO plus gloo's own handshake is the
    model, with no extra messages.

The caller's tensors are freed on the caller's thread. One whose last reference goes on another
thread is freed there, and the profiler, which watches the caller's thread, never sees the free:
its running total of allocated bytes (what StepPeak reads on CPU ranks) only grows (a 1 MB tensor
freed on another thread three times left 3 MB "allocated"). So the worker never drops a unit: it
hands each unit it has run to `finished`, and the caller's thread lets go of it (`wait`, or
`release` at its next post for a unit nobody waited on: the futures DDP's hooks chain on). gloo's
own threads let go of what a gloo call was handed just after completing it, so on CPU ranks a unit
hands gloo copies it makes on the worker (refimpl.lab.runtime.shared_device), never the caller's tensors:
memory made on a thread the profiler does not watch is invisible to it, made and freed.

A unit that has not finished `timeout` seconds after it started (REFIMPL_STAGED_TIMEOUT, default
the group's timeout) fails with the rank, the blocked operation and what waits behind it; every
later unit of the stream fails with it, so the host's wait raises instead of hanging. The timeout
cannot tell a hang from a slow peer: a test sets it short only where no wait is legitimately long.
Everything the worker touches is host memory (shared_device stages device tensors on the caller's
thread), so the worker never runs a CUDA call.
"""
from __future__ import annotations

import collections
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

TIMEOUT_ENV = "REFIMPL_STAGED_TIMEOUT"


@dataclass
class Unit:
    """What the stream runs as one: `start()` posts it to gloo and returns the Works to wait for;
    `what` names it in an error ("recv from group rank 1, tag 0, 640 B")."""

    start: Callable[[], list]
    what: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    dropped: threading.Event = field(default_factory=threading.Event)   # the worker holds it no more
    then: Callable[[], None] | None = None   # run by the worker once its Works are done
    error: str | None = None
    on_done: Callable[[str | None], None] | None = None   # told the error (None: it ran)

    def finish(self) -> None:
        """Mark the unit run (or failed, `error`): wakes `result`, then tells `on_done`."""
        self.done.set()
        if self.on_done is not None:
            self.on_done(self.error)

    def result(self) -> None:
        """Block until the stream has run this unit; raise its failure."""
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(self.error)


class Stream:
    """The rank's operations on one group, run in posting order by one worker thread."""

    def __init__(self, group_rank: int, timeout: timedelta):
        self.group_rank = group_rank
        seconds = os.environ.get(TIMEOUT_ENV)
        self.timeout = float(seconds) if seconds else timeout.total_seconds()
        self.queue: queue.Queue = queue.Queue()
        self.waiting: list[Unit] = []          # submitted, not yet started (for the error message)
        self.lock = threading.Lock()
        self.failed: str | None = None
        self.count = 0                         # units started so far
        self.worker: threading.Thread | None = None
        self.finished: collections.deque = collections.deque()   # (number, unit) run, still held
        self.released = 0                      # units up to this number the worker holds no more

    def release(self) -> None:
        """On the caller's thread: let go of the units the worker has run and dropped (the module
        docstring), so that what only they still hold is freed here."""
        while self.finished and self.finished[0][0] <= self.released:
            self.finished.popleft()

    def wait(self, unit: Unit) -> None:
        """On the caller's thread: block until the stream has run `unit` and let go of it; raise
        its failure."""
        unit.dropped.wait()
        self.release()
        unit.result()

    def submit(self, unit: Unit) -> Unit:
        self.release()
        with self.lock:
            self.waiting.append(unit)
            if self.worker is None:    # daemon: a rank that failed must still be able to exit
                self.worker = threading.Thread(target=self._loop, name="staged-stream", daemon=True)
                self.worker.start()
        self.queue.put(unit)
        return unit

    def _loop(self) -> None:
        while True:
            unit = self.queue.get()
            with self.lock:
                self.waiting.remove(unit)
            self.count += 1
            number = self.count
            if self.failed is None:
                try:
                    self._run(unit)
                except RuntimeError as e:
                    self.failed = str(e)
                    unit.error = self.failed
            else:
                unit.error = f"an earlier operation on this stream failed: {self.failed}"
            self.finished.append((number, unit))   # the caller's thread drops it (`release`)
            dropped = unit.dropped
            unit.finish()
            del unit
            self.released = number
            dropped.set()

    def _run(self, unit: Unit) -> None:
        started = time.monotonic()
        works = unit.start()                   # a group's operations all start together
        for work in works:
            left = self.timeout - (time.monotonic() - started)
            try:
                work.wait(timedelta(seconds=max(left, 0.001)))
            except RuntimeError as e:
                raise RuntimeError(self._blocked(unit, time.monotonic() - started, e)) from None
        if unit.then is not None:
            unit.then()

    def _blocked(self, unit: Unit, waited: float, cause: Exception) -> str:
        with self.lock:
            behind = [what for u in self.waiting[:3] for what in u.what]
        rank = dist.get_rank() if dist.is_initialized() else self.group_rank
        timed_out = "Timed out" in str(cause)
        why = (f"no progress for {waited:.1f} s (REFIMPL_STAGED_TIMEOUT={self.timeout:g})" if timed_out
               else f"failed after {waited:.1f} s: {str(cause).splitlines()[0][:160]}")
        return (f"staged backend, NCCL's stream order: rank {rank} (group rank {self.group_rank}) "
                f"blocked in {' + '.join(unit.what)} -- operation {self.count} of its stream -- {why}; "
                f"waiting behind it: {behind or 'nothing'}. On NCCL this posting order hangs: each "
                "operation waits for the one before it, and a send for the peer's receive to start.")
