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

NCCL's argument rules, enforced on every call (`StagedGloo._check`), so a call NCCL would
refuse fails here on CPU ranks too, with the rule it breaks (gloo forgives each of them):
  * every tensor on the rank's device (NCCL: "Tensors must be CUDA and dense"), DTensor's
    collectives too: FSDP2's host shards under CPUOffloadPolicy handed to `full_tensor()` are
    refused (tests/test_nccl_rules.py, `_fsdp2_offload_gather`);
  * every tensor contiguous (ProcessGroupNCCL: "Tensors must be contiguous" for a collective's
    input; for a send or receive it only warns and leaves matching the two sides' layouts to the
    caller, and a list of outputs it copies into: here both are refused, the project's rule);
  * a dtype NCCL has (`NCCL_DTYPES`: no int16, uint16, uint32 or uint64), a reduce op it has (no
    BAND, BOR or BXOR), no AVG of bool, and of complex tensors only SUM, AVG and PREMUL_SUM
    (ProcessGroupNCCL reduces them as pairs of reals, which is only right for those).

Semantics kept from NCCL, and where they differ:
  * every operation on a group -- a collective, a send, a receive, or a batch of sends and
    receives (torch's batch_isend_irecv, which refimpl.comm.p2p.post uses: `p2p_group`) --
    runs on that group's one stream (refimpl.lab.runtime.staged_stream): in posting order, one unit at a
    time, a send completing only once the peer's matching receive has started. A posting order
    that would hang on NCCL hangs here too, and fails after REFIMPL_STAGED_TIMEOUT seconds naming
    the rank and the blocked operation (tests/test_nccl_rules.py: the pipeline's old posting);
  * a collective is queued on the same stream and runs there while the caller goes on, as NCCL's
    does on its CUDA stream, so async_op=True overlaps compute and keeps its buffers in flight as
    on NCCL (on a GPU the copy back is the caller's, so there a collective blocks until its result
    is back). A CPU trace shows it: each collective in flight is a `gloo:<op>` range, from the
    call to its completion (`_backend_range`), as gloo's own ranges are;
  * a send or receive returns at once and runs when the stream reaches it; on a GPU a receive's
    copy back to the device happens in `wait`, on the caller's thread;
  * on a GPU every copy to the host and back runs inside a `staged:copy` range (`_staging`): a
    CUDA trace is read off the GPU's kernels (refimpl.lab.trace.kernels), where those copies are this
    backend's communication, not compute;
  * on CPU ranks gloo is handed copies the stream's worker makes, and results are copied back
    there, never the caller's tensors themselves: refimpl.lab.runtime.staged_stream says why (the
    profiler's account of frees). A copy is read when the stream reaches its operation, as NCCL
    reads a buffer when its stream does;
  * gloo matches point-to-point by tag and NCCL by posting order: every staged send and receive
    reaches gloo with one tag (`NCCL_TAG`), so messages pair in posting order, as on NCCL (the
    one-tag mode, REFIMPL_P2P_TAGS=one in refimpl.lab.runtime.one_tag, does the same on plain gloo).

On a CPU-only machine `REFIMPL_SHARED_DEVICE=cpu` runs the same backend, and `make test` runs
every rank launch so (the Makefile's STAGED): every strategy, notebook helper and bench rank the
suite starts keeps NCCL's stream order, pairing and argument rules; tests/test_nccl_rules.py
compares staged runs with plain gloo's.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from refimpl.lab.runtime.staged_stream import Stream, Unit

ENV = "REFIMPL_SHARED_DEVICE"
BACKEND = "staged"

# The dtypes ProcessGroupNCCL maps to an NCCL type (bool as uint8; complex as pairs of reals).
NCCL_DTYPES = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
               torch.float32, torch.float64, torch.bool, torch.complex64, torch.complex128,
               torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


# NCCL ignores tags: between two ranks it pairs sends and receives in posting order. Every message
# of a staged group goes to gloo with this one tag, so gloo pairs them so too, whoever posts them
# (PyTorch's pipelining and DTensor's as well as refimpl.comm.p2p; REFIMPL_P2P_TAGS=one does
# the same on plain gloo).
NCCL_TAG = 0


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


def _backend_range(op: str, done: torch.futures.Future) -> torch.futures.Future:
    """While the profiler runs: a range `gloo:<op>` from now until `done` completes, the time the
    collective is in flight, as gloo's own range on its worker thread is in a plain gloo trace.

    The gloo call itself runs on the stream's worker thread, which the profiler does not record
    (it records the thread that started it, and threads torch hands its state to), so without this
    a staged trace has no backend range and its overlap reads as none. The range opens here, on the
    caller's thread, and torch's `_call_end_callbacks_on_future` (made for asynchronous RPC) closes
    it when `done` completes, under the caller's profiler state; refimpl.lab.trace.profiling reads a
    gloo:/nccl: range as communication in flight, not as time its thread spends in a call. Returns
    the future to wait on: `done`'s value, once the range is closed."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return done
    in_flight = torch.autograd.profiler.record_function(f"gloo:{op}")
    in_flight.__enter__()
    return in_flight._call_end_callbacks_on_future(done)


# The range around a staged call's host<->device copies on a GPU (the module docstring); the
# trace reader knows it by this name (refimpl.lab.trace.kernels.STAGING_COPY, a layer above this one).
STAGING_RANGE = "staged:copy"


def _staging():
    return torch.autograd.profiler.record_function(STAGING_RANGE)


def _fill(t: torch.Tensor, received: torch.Tensor) -> None:
    """Write what a receive or collective got into the caller's tensor, as gloo and NCCL write
    it: outside autograd (PyTorch's pipelining receives into a leaf that already requires grad)."""
    with torch.no_grad():
        t.copy_(received)


def _done(result) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class _Queued(dist.Work):
    """An operation on the group's stream: `wait` waits until the stream has run its unit and
    raises the stream's failure, then copies each received host buffer onto its device tensor (a
    send's host copy is kept alive until then). A collective's also carries the future DDP's
    communication hooks chain on (`get_future`: the outputs, once the unit has run).

    Not torch's future-backed Work (`_create_work_from_future`): its `wait` returns normally when
    the future holds an exception, so a collective that failed (a peer gone, the stream's timeout)
    would look done and the rank would go on with the tensors it had."""

    def __init__(self, stream: Stream, unit: Unit, copies: list[tuple[torch.Tensor, torch.Tensor]],
                 keep=(), future: torch.futures.Future | None = None):
        super().__init__()
        self.stream, self.unit, self.copies, self.keep, self.future = stream, unit, copies, keep, future

    def wait(self, timeout=None) -> bool:
        self.stream.wait(self.unit)
        if self.future is not None:
            self.future.wait()            # the profiler's range is closed by then
        if self.copies:                   # a receive on a GPU: its host buffers onto the device
            with _staging():
                for host, device_tensor in self.copies:
                    if host is not device_tensor:
                        _fill(device_tensor, host)
        self.copies, self.keep = [], ()
        return True

    def is_completed(self) -> bool:
        return self.unit.done.is_set()

    def get_future(self) -> torch.futures.Future:
        if self.future is None:
            raise RuntimeError("a staged send or receive has no future (wait on it)")
        return self.future


class StagedGloo(dist.ProcessGroup):
    """gloo on host copies of device tensors, refusing any tensor not on the rank's device."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, device: torch.device):
        super().__init__(rank, size)
        self.device = device
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.stream = Stream(rank, timeout)   # every gloo call goes through its one worker
        self.open = threading.local()        # .group inside p2p_group: (parts so far, its unit),
        #                                       per thread, as ncclGroupStart is (refimpl.lab.runtime.lane)

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        # c10d keeps the name it gave this group in its own table (DeviceMesh.from_group, which
        # PyTorch's twins use, reads it; a Python process group has no C++ name set)
        return dist.distributed_c10d._world.pg_names[self]

    # -- staging --------------------------------------------------------------------------------
    def _check(self, tensors, op: str, opts=None) -> None:
        """NCCL's argument rules (the module docstring); `opts` carries a reduce op, if any."""
        for t in tensors:
            if t.device != self.device:
                raise RuntimeError(f"{op}: a tensor on {t.device}, but this rank's device is "
                                   f"{self.device} (NCCL would refuse it)")
            if not t.is_contiguous():
                raise RuntimeError(f"{op}: a non-contiguous tensor (shape {tuple(t.shape)}, strides "
                                   f"{t.stride()}): NCCL would refuse it ('Tensors must be contiguous')")
            if t.dtype not in NCCL_DTYPES:
                raise RuntimeError(f"{op}: dtype {t.dtype}, which NCCL has no type for "
                                   "(NCCL would refuse it)")
        reduce_op = getattr(opts, "reduceOp", None)
        if reduce_op is None:
            return
        name = str(reduce_op.op).split(".")[-1]           # RedOpType.SUM -> SUM
        if name in ("BAND", "BOR", "BXOR"):
            raise RuntimeError(f"{op}: ReduceOp.{name}, which NCCL does not have (NCCL would refuse it)")
        if name == "AVG" and any(t.dtype == torch.bool for t in tensors):
            raise RuntimeError(f"{op}: ReduceOp.AVG of bool tensors (NCCL would refuse it)")
        if name not in ("SUM", "AVG", "PREMUL_SUM") and any(t.is_complex() for t in tensors):
            raise RuntimeError(f"{op}: ReduceOp.{name} of complex tensors (NCCL would refuse it)")

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device.type == "cpu" else t.detach().to("cpu")

    def _run(self, op: str, outputs: list, inputs: list, call, opts=None) -> dist.Work:
        """Check, stage the inputs, run `call(host_outputs, host_inputs)` on gloo, copy back.

        On CPU ranks the collective is queued on the group's stream and runs there while the
        caller goes on, as NCCL's runs on its CUDA stream (`_queue`): the Work completes when the
        stream has run it, so an async_op=True collective overlaps the compute that follows it
        and holds its buffers while in flight. On a GPU the copy back to the device is the
        caller's, so the call blocks until the result is back."""
        self._check(outputs + inputs, op, opts)
        if all(t.device.type == "cpu" for t in outputs + inputs):
            return self._queue(op, outputs, inputs, call)
        with _staging():
            host_in = [self._host(t) for t in inputs]
            host_of = {id(t): h for t, h in zip(inputs, host_in)}
            host_out = [host_of.get(id(t)) if id(t) in host_of else self._host(t) for t in outputs]
        unit = Unit(lambda: [call(host_out, host_in)], [op])
        self.stream.wait(self.stream.submit(unit))
        with _staging():
            for t, h in zip(outputs, host_out):
                if h is not t:
                    t.copy_(h)
        return _done(outputs)

    def _queue(self, op: str, outputs: list, inputs: list, call) -> dist.Work:
        """A collective of CPU tensors, queued on the stream (`_run`). gloo is handed copies the
        stream's worker makes when it starts the unit, and the results are copied back there once
        gloo is done: gloo's own thread drops what it was handed after the call completes, and a
        tensor of the caller's freed there would leave the profiler's running total of allocated
        bytes too high (refimpl.lab.runtime.staged_stream). The copies are read when the stream reaches the
        collective, as NCCL reads its buffers when its stream does."""
        results = []

        def start() -> list:
            copies = {id(t): t.clone() for t in inputs}          # on the worker thread
            results.append([copies[id(t)] if id(t) in copies else torch.empty_like(t) for t in outputs])
            return [call(results[0], [copies[id(t)] for t in inputs])]

        def copy_back() -> None:
            for t, result in zip(outputs, results.pop()):
                _fill(t, result)

        done = torch.futures.Future()
        traced = _backend_range(op, done)

        def complete(error: str | None) -> None:
            if error is None:
                done.set_result(outputs)       # what a Work's result() and future hold
            else:
                done.set_exception(RuntimeError(error))

        unit = Unit(start, [op], then=copy_back, on_done=complete)
        self.stream.submit(unit)
        return _Queued(self.stream, unit, [], future=traced)

    # -- collectives ----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._run("all_reduce", tensors, tensors, lambda o, i: self.inner.allreduce(o, opts),
                         opts=opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._run("all_reduce_coalesced", tensors, tensors,
                         lambda o, i: self.inner.allreduce_coalesced(o, opts), opts=opts)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._run("broadcast", tensors, tensors, lambda o, i: self.inner.broadcast(o, opts), opts=opts)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        return self._run("reduce", tensors, tensors, lambda o, i: self.inner.reduce(o, opts), opts=opts)

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or dist.GatherOptions()
        flat = [t for out in output_lists for t in out]
        return self._run("gather", flat, inputs, lambda o, i: self.inner.gather(
            _lists(o, len(output_lists)), i, opts), opts=opts)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        flat = [t for lst in input_lists for t in lst]
        return self._run("scatter", outputs, flat, lambda o, i: self.inner.scatter(
            o, _lists(i, len(input_lists)), opts), opts=opts)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        flat = [t for out in output_lists for t in out]
        return self._run("all_gather", flat, inputs, lambda o, i: self.inner.allgather(
            _lists(o, len(output_lists)), i, opts), opts=opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        flat = [t for lst in input_lists for t in lst]
        return self._run("reduce_scatter", outputs, flat, lambda o, i: self.inner.reduce_scatter(
            o, _lists(i, len(input_lists)), opts), opts=opts)

    # torch 2.13 calls the *_single names, older releases the _base ones: both are provided.
    def all_gather_single(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run("all_gather_into_tensor", [output], [input],
                         lambda o, i: self.inner._allgather_base(o[0], i[0], opts), opts=opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run("all_gather_into_tensor_coalesced", outputs, inputs,
                         lambda o, i: _each(self.inner._allgather_base, o, i, opts), opts=opts)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run("reduce_scatter_tensor", [output], [input],
                         lambda o, i: self.inner._reduce_scatter_base(o[0], i[0], opts), opts=opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run("reduce_scatter_tensor_coalesced", outputs, inputs,
                         lambda o, i: _each(self.inner._reduce_scatter_base, o, i, opts), opts=opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._run("all_to_all_single", [output], [input],
                         lambda o, i: self.inner.alltoall_base(o[0], i[0], output_split_sizes,
                                                               input_split_sizes, opts), opts=opts)

    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        flat = [t for out in output_lists for t in out]
        return self._run("all_gather_coalesced", flat, inputs, lambda o, i: self.inner.allgather_coalesced(
            _lists(o, len(output_lists)), i, opts), opts=opts)

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._run("all_to_all", outputs, inputs,
                         lambda o, i: self.inner.alltoall(o, i, opts), opts=opts)

    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        self.stream.wait(self.stream.submit(Unit(lambda: [self.inner.barrier(opts)], ["barrier"])))
        return _done([])

    # -- point to point: posted now, run when the stream reaches them ----------------------------
    @contextmanager
    def p2p_group(self):
        """The sends and receives posted inside run as one unit of the stream, all started
        together, as between NCCL's ncclGroupStart and ncclGroupEnd (`_batch_isend_irecv` opens
        it around torch's batch_isend_irecv, which a Python process group gets one by one)."""
        parts: list = []                       # (what, start, then) of each operation posted inside
        unit = Unit(lambda: [start() for _, start, _ in parts], [],
                    then=lambda: [then() for _, _, then in parts if then is not None])
        self.open.group = (parts, unit)
        try:
            yield
        except BaseException:
            unit.error = "the group's posting raised"
            unit.finish()
            unit.dropped.set()                 # it never reached the worker
            raise
        finally:
            self.open.group = None
        if parts:
            unit.what[:] = [what for what, _, _ in parts]
            self.stream.submit(unit)

    def _post(self, what: str, start, then=None) -> Unit:
        grouped = getattr(self.open, "group", None)
        if grouped is None:
            return self.stream.submit(Unit(lambda: [start()], [what], then=then))
        parts, unit = grouped
        parts.append((what, start, then))
        return unit

    def send(self, tensors, dst: int, tag: int = 0):
        self._check(tensors, "send")
        what = f"send to group rank {dst} (tag {tag}, {sum(t.nbytes for t in tensors)} B)"
        if all(t.device.type == "cpu" for t in tensors):
            # gloo sends a copy the worker makes when the stream reaches the send (`_queue`'s why)
            return _Queued(self.stream, self._post(what, lambda: self.inner.send(
                [t.clone() for t in tensors], dst, NCCL_TAG)), [], keep=tensors)
        with _staging():
            host = [self._host(t) for t in tensors]
        return _Queued(self.stream, self._post(what, lambda: self.inner.send(host, dst, NCCL_TAG)), [],
                       keep=host)

    def recv(self, tensors, src: int, tag: int = 0):
        self._check(tensors, "recv")
        what = f"recv from group rank {src} (tag {tag}, {sum(t.nbytes for t in tensors)} B)"
        if all(t.device.type == "cpu" for t in tensors):
            # gloo receives into buffers the worker makes, copied into `tensors` there once
            # received (`_queue`'s why)
            received = []

            def start():
                received.append([torch.empty_like(t) for t in tensors])
                return self.inner.recv(received[0], src, NCCL_TAG)

            def copy_back():
                for t, r in zip(tensors, received.pop()):
                    _fill(t, r)

            return _Queued(self.stream, self._post(what, start, copy_back), [], keep=tensors)
        host = [torch.empty_like(t, device="cpu") for t in tensors]
        return _Queued(self.stream, self._post(what, lambda: self.inner.recv(host, src, NCCL_TAG)),
                       list(zip(host, tensors)))


_torch_batch_isend_irecv = dist.batch_isend_irecv


def _batch_isend_irecv(p2p_op_list):
    """torch's batch_isend_irecv, whose batch is one group on a staged group's stream. torch
    coalesces a batch only for its own C++ process groups; on a Python one such as StagedGloo it
    posts the operations one by one, which under the stream's order would make a send and a
    receive to the same peer wait for each other -- the hang the batch is there to avoid on NCCL
    (refimpl.comm.p2p.post, torch.distributed.pipelining's schedules)."""
    group = p2p_op_list[0].group if p2p_op_list else None
    group = group if group is not None else dist.group.WORLD
    if not isinstance(group, StagedGloo):
        return _torch_batch_isend_irecv(p2p_op_list)
    with group.p2p_group():
        return _torch_batch_isend_irecv(p2p_op_list)


def _create(store, rank: int, size: int, timeout: timedelta) -> StagedGloo:
    return StagedGloo(store, rank, size, timeout, shared_device() or torch.device("cpu"))


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    # in this process only (a rank that asked for the staged backend: refimpl.launch)
    dist.batch_isend_irecv = _batch_isend_irecv
