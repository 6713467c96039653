"""The lab's instruments on refimpl.seam: every collective a mechanism calls is labelled, counted in
the open CommLogs and entered in the flight recorder, without the mechanism naming any of it.

Registered in pyproject.toml under the entry-point group "refimpl.seam"; refimpl.seam calls
`attach(SEAM)` once, on first use, in every process (each rank, a notebook's kernel).

The bytes of a label are the whole message the collective is about (labels.py's convention): the
tensor all-reduced or broadcast, the gathered output of an all-gather, the full input of a
reduce-scatter, one rank's input buffer of an all-to-all, the tensor of a point-to-point message.
"""
from __future__ import annotations

from torch.distributed import ReduceOp

import refimpl.comm
from refimpl.lab.instrument import labels
from refimpl.lab.instrument.counter import op_scope, record_recv, record_send
from refimpl.lab.runtime.lane import on_lane
from refimpl.seam import lookup


def _size(t) -> int:
    return t.numel() * t.element_size()


def _all(ts) -> int:
    return sum(_size(t) for t in ts)


# collective -> the message's bytes, from torch.distributed's positional arguments
MESSAGE = {
    "all_reduce": lambda a: _size(a[0]),
    "broadcast": lambda a: _size(a[0]),
    "reduce": lambda a: _size(a[0]),
    "all_gather": lambda a: _all(a[0]),
    "all_gather_into_tensor": lambda a: _size(a[0]),
    "reduce_scatter": lambda a: _all(a[1]),
    "reduce_scatter_tensor": lambda a: _size(a[1]),
    "all_to_all": lambda a: _all(a[1]),
    "all_to_all_single": lambda a: _size(a[1]),
    "gather": lambda a: _size(a[0]),
    "scatter": lambda a: _size(a[0]),
}
POINT_TO_POINT = {"send": "dst", "recv": "src", "isend": "dst", "irecv": "src"}


class LabelledWork:
    """An asynchronous collective's handle whose wait() is labelled `comm:wait` (where a rank
    blocks for the network shows in a trace)."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        with labels.comm_span("wait"):
            return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


class ReceiveWait:
    """A point-to-point receive's handle whose wait() is labelled `recv-wait`, with the message's
    bytes, group, peer and tag: where a pipeline stage waits for its neighbour, the call a hang
    report names (the innermost phase open says which action: refimpl.parallel.pp.links)."""

    def __init__(self, work, nbytes: int, group, peer, tag):
        self.work, self.nbytes, self.group, self.peer, self.tag = work, nbytes, group, peer, tag

    def wait(self, *args, **kwargs):
        with labels.comm_span("recv-wait", self.nbytes, group=self.group, peer=self.peer, tag=self.tag):
            return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def _peer(name: str, args, kwargs, group):
    """The peer's global rank, however the caller named it (for the flight recorder)."""
    side = POINT_TO_POINT[name]
    peer = args[1] if len(args) > 1 else kwargs.get(side)
    group_peer = kwargs.get(f"group_{side}")
    if peer is None and group_peer is not None and group is not None:
        import torch.distributed as dist
        return dist.get_global_rank(group, group_peer)
    return peer if peer is not None else group_peer


def labelled(name: str, fn):
    """`fn` (collective `name` of the seam's current collectives) with its label around it."""
    if name in MESSAGE:
        def call(*args, **kwargs):
            group = kwargs.get("group")
            with labels.comm_span(_op_name(name, args, kwargs), MESSAGE[name](args),
                                  world=_world(group), group=group):
                work = fn(*args, **kwargs)
            return LabelledWork(work) if work is not None and kwargs.get("async_op") else work
    elif name in POINT_TO_POINT:
        def call(*args, **kwargs):
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            tag = kwargs.get("tag", args[3] if len(args) > 3 else 0)
            peer = _peer(name, args, kwargs, group)
            with span(name, _size(args[0]), group, peer, tag):
                work = fn(*args, **kwargs)
            return ReceiveWait(work, _size(args[0]), group, peer, tag) if name == "irecv" else work
    else:
        return fn
    call.__name__ = call.__qualname__ = name
    return call


# A collective's label names the operation, not torch's variant of its signature (the names the
# cost model, lab.measure.moe_collectives and the notebooks count by).
OPERATION = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_to_all_single": "all_to_all"}


def _op_name(name: str, args, kwargs) -> str:
    """The operation a call is labelled with; an all-reduce taking the maximum is `all_reduce_max`
    (the vocabulary-parallel loss's row max: its own row in lab.measure.moe_collectives' counts)."""
    if name != "all_reduce":
        return OPERATION.get(name, name)
    op = kwargs.get("op", args[1] if len(args) > 1 else None)
    return "all_reduce_max" if op == ReduceOp.MAX else name


def _world(group) -> int | None:
    import torch.distributed as dist
    return dist.get_world_size(group) if dist.is_initialized() else None


class LabelledCollectives:
    """What `refimpl.seam.dist.<name>` finds once the lab is attached: the seam's current
    collectives (torch.distributed or refimpl.comm), each with its label; refimpl.comm's run
    with async_op=True on the lab's lane, beside the caller (refimpl.lab.runtime.lane)."""

    def __init__(self, seam):
        self.seam = seam
        self._made: dict = {}

    def __getattr__(self, name: str):
        fn = lookup(self.seam.collectives, name)
        key = (name, fn)
        made = self._made.get(key)
        if made is None:
            laned = self.seam.collectives is refimpl.comm and name in MESSAGE
            made = self._made[key] = labelled(name, on_lane(fn) if laned else fn)
        return made


def span(op: str, nbytes: int | None = None, group=None, peer: int | None = None,
         tag: int | None = None):
    """refimpl.comm's own hook: a collective it runs (its sends counted under its name) or one of
    the messages a collective is built from (counted as sent or received)."""
    if op in POINT_TO_POINT:
        (record_send if op in ("send", "isend") else record_recv)(nbytes)
        return _both(op_scope("p2p"), labels.comm_span(op, nbytes, group=group, peer=peer, tag=tag))
    return _both(labels.comm_span(op, nbytes, group=group), op_scope(op))


class _both:
    def __init__(self, a, b):
        self.a, self.b = a, b

    def __enter__(self):
        self.a.__enter__()
        self.b.__enter__()

    def __exit__(self, *exc):
        self.b.__exit__(*exc)
        self.a.__exit__(*exc)


def message(direction: str, nbytes: int) -> None:
    """A message of one of refimpl.comm's collectives, counted in the open CommLogs."""
    (record_send if direction == "sent" else record_recv)(nbytes)


def attach(seam) -> None:
    seam.calls = LabelledCollectives(seam)
    seam.phase = labels.phase
    seam.span = span
    seam.message = message
