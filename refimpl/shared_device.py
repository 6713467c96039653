"""Several ranks on one device: a process-group backend ("staged") that stages through gloo.

NCCL gives each rank a GPU of its own and refuses two ranks on one device, so a machine with one
GPU could never run the multi-rank paths on CUDA tensors. With

    REFIMPL_SHARED_DEVICE=cuda:0 python -m refimpl train --strategy zero3 --nproc 4 ...

every rank computes on that one device, and its process group is `StagedGloo`: each collective
and point-to-point call first checks that every tensor it is handed is on the rank's device -- the
rule NCCL enforces, so a CPU tensor fails here as it would fail there -- then copies the tensors
to host memory, runs gloo on the copies, and copies the results back. The maths is gloo's (the
same as on CPU ranks); what the harness adds is that every strategy, schedule and twin runs
multi-rank on CUDA tensors (scripts/gpu_check.sh runs it), where a tensor left on the default
device, a `.cpu()` inside a step or a device mismatch in a send shows up.

Semantics kept from NCCL, and where they differ:
  * a collective runs when it is called (the copy back completes before the call returns):
    asynchronous ops (async_op=True) return a finished Work, so the overlap tests read nothing
    here; correctness does not depend on it, because every rank posts its collectives in one order;
  * a receive stays pending until waited on (the copy back happens in `wait`), and a send returns
    at once: pipeline ranks post receives before sends, which a blocking receive would deadlock;
  * gloo matches point-to-point by tag and NCCL by posting order: the one-tag mode
    (REFIMPL_P2P_TAGS=one, refimpl.comm.p2p) checks that order on CPU ranks already.

On a CPU-only machine `REFIMPL_SHARED_DEVICE=cpu` runs the same backend (the staging copies are
then no-ops): tests/test_shared_device.py checks there that every strategy's collectives are ones
the backend implements, and that the runs equal `single`.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

ENV = "REFIMPL_SHARED_DEVICE"
BACKEND = "staged"


def shared_device() -> torch.device | None:
    """The device every rank shares (REFIMPL_SHARED_DEVICE), or None when the harness is off."""
    name = os.environ.get(ENV)
    return torch.device(name) if name else None


def _each(op, outputs, inputs, opts):
    """A coalesced call as one call per pair (gloo has no coalesced form of it): the last
    Work, after waiting for the others (they ran in order on one gloo context)."""
    works = [op(o, i, opts) for o, i in zip(outputs, inputs)]
    for w in works[:-1]:
        w.wait()
    return works[-1] if works else _done([])


def _lists(flat: list, count: int) -> list[list]:
    """`flat` cut back into `count` equal lists (the list-of-lists collectives are staged flat)."""
    n = len(flat) // count if count else 0
    return [flat[k * n:(k + 1) * n] for k in range(count)]


def _done(result) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class _Pending(dist.Work):
    """A point-to-point call posted to gloo on host buffers; `wait` waits for it, then copies each
    received host buffer onto its device tensor (a send's host copy is kept alive until then)."""

    def __init__(self, work, copies: list[tuple[torch.Tensor, torch.Tensor]], keep=()):
        super().__init__()
        self.work, self.copies, self.keep = work, copies, keep

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        for host, device_tensor in self.copies:
            if host is not device_tensor:
                device_tensor.copy_(host)
        self.copies, self.keep = [], ()
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class StagedGloo(dist.ProcessGroup):
    """gloo on host copies of device tensors, refusing any tensor not on the rank's device."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, device: torch.device):
        super().__init__(rank, size)
        self.device = device
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        # c10d keeps the name it gave this group in its own table (DeviceMesh.from_group, which
        # PyTorch's twins use, reads it; a Python process group has no C++ name set)
        return dist.distributed_c10d._world.pg_names[self]

    # -- staging --------------------------------------------------------------------------------
    def _check(self, tensors, op: str) -> None:
        for t in tensors:
            if t.device != self.device:
                raise RuntimeError(f"{op}: a tensor on {t.device}, but this rank's device is "
                                   f"{self.device} (NCCL would refuse it)")

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == "cpu" else t.detach().to("cpu")

    def _run(self, op: str, outputs: list, inputs: list, call) -> dist.Work:
        """Check, stage the inputs, run `call(host_outputs, host_inputs)` on gloo, copy back."""
        self._check(outputs + inputs, op)
        host_in = [self._host(t) for t in inputs]
        host_of = {id(t): h for t, h in zip(inputs, host_in)}
        host_out = [host_of.get(id(t)) if id(t) in host_of else self._host(t) for t in outputs]
        call(host_out, host_in).wait()
        for t, h in zip(outputs, host_out):
            if h is not t:
                t.copy_(h)
        return _done(outputs)

    # -- collectives ----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._run("all_reduce", tensors, tensors, lambda o, i: self.inner.allreduce(o, opts))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._run("all_reduce_coalesced", tensors, tensors,
                         lambda o, i: self.inner.allreduce_coalesced(o, opts))

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._run("broadcast", tensors, tensors, lambda o, i: self.inner.broadcast(o, opts))

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        return self._run("reduce", tensors, tensors, lambda o, i: self.inner.reduce(o, opts))

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or dist.GatherOptions()
        flat = [t for out in output_lists for t in out]
        return self._run("gather", flat, inputs, lambda o, i: self.inner.gather(
            _lists(o, len(output_lists)), i, opts))

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        flat = [t for lst in input_lists for t in lst]
        return self._run("scatter", outputs, flat, lambda o, i: self.inner.scatter(
            o, _lists(i, len(input_lists)), opts))

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        flat = [t for out in output_lists for t in out]
        return self._run("all_gather", flat, inputs, lambda o, i: self.inner.allgather(
            _lists(o, len(output_lists)), i, opts))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        flat = [t for lst in input_lists for t in lst]
        return self._run("reduce_scatter", outputs, flat, lambda o, i: self.inner.reduce_scatter(
            o, _lists(i, len(input_lists)), opts))

    # torch 2.13 calls the *_single names, older releases the _base ones: both are provided.
    def all_gather_single(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run("all_gather_into_tensor", [output], [input],
                         lambda o, i: self.inner._allgather_base(o[0], i[0], opts))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run("all_gather_into_tensor_coalesced", outputs, inputs,
                         lambda o, i: _each(self.inner._allgather_base, o, i, opts))

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run("reduce_scatter_tensor", [output], [input],
                         lambda o, i: self.inner._reduce_scatter_base(o[0], i[0], opts))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run("reduce_scatter_tensor_coalesced", outputs, inputs,
                         lambda o, i: _each(self.inner._reduce_scatter_base, o, i, opts))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._run("all_to_all_single", [output], [input],
                         lambda o, i: self.inner.alltoall_base(o[0], i[0], output_split_sizes,
                                                               input_split_sizes, opts))

    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        flat = [t for out in output_lists for t in out]
        return self._run("all_gather_coalesced", flat, inputs, lambda o, i: self.inner.allgather_coalesced(
            _lists(o, len(output_lists)), i, opts))

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._run("all_to_all", outputs, inputs,
                         lambda o, i: self.inner.alltoall(o, i, opts))

    def barrier(self, opts=None):
        return self.inner.barrier(opts or dist.BarrierOptions())

    # -- point to point: a send returns at once, a receive completes when waited on ---------------
    def send(self, tensors, dst: int, tag: int = 0):
        self._check(tensors, "send")
        host = [self._host(t) for t in tensors]
        return _Pending(self.inner.send(host, dst, tag), [], keep=host)

    def recv(self, tensors, src: int, tag: int = 0):
        self._check(tensors, "recv")
        host = [t if t.device.type == "cpu" else torch.empty_like(t, device="cpu") for t in tensors]
        return _Pending(self.inner.recv(host, src, tag), list(zip(host, tensors)))


def _create(store, rank: int, size: int, timeout: timedelta) -> StagedGloo:
    return StagedGloo(store, rank, size, timeout, shared_device() or torch.device("cpu"))


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
