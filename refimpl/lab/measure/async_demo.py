"""What `async_op=True` buys, shown on live ranks: compute runs while the collective is in flight.

A blocking `all_reduce` returns with the result in place, so nothing else runs on this thread
meanwhile. An asynchronous one returns a `Work` at once; until `.wait()`, this thread is free. The
demo counts how many compute iterations the thread finished while the handle still reported the
collective as not completed: at least one means compute and communication really overlapped.

That count means something on CPU ranks only (gloo, or the staged backend on the CPU): there the
thread's loop is the compute, and refimpl.comm's all-reduce on the lab's lane (refimpl.lab.runtime.lane)
is the communication.
On a GPU the loop would only launch kernels, and a handle reports when the host is done, not the
device, so there the row says the overlap was not measured (`iterations_while_in_flight` None);
a GPU's overlap is read from the kernels on its streams (notebook 02's trace). refimpl.comm's
asynchronous collectives do not run on NCCL at all (refimpl.lab.runtime.lane.LANE_ON_NCCL): run the demo
with backend="gloo".
"""
from __future__ import annotations

import torch

import refimpl.comm as comm
from refimpl.lab.runtime.lane import on_lane
from refimpl.launch import device_for


def overlap_demo(rank: int, world_size: int, numel: int = 1 << 20) -> dict:
    """Run on every rank (launch.run): one blocking and one asynchronous all-reduce of `numel`."""
    import torch.distributed as dist

    device = device_for(dist.get_backend())
    all_reduce = on_lane(comm.all_reduce)           # async_op=True runs beside this thread
    want = float(sum(range(world_size)))
    blocking = torch.full((numel,), float(rank), device=device)
    all_reduce(blocking)                            # returns when the result is in place
    x = torch.full((numel,), float(rank), device=device)
    a = torch.randn(128, 128, device=device)
    handle = all_reduce(x, async_op=True)           # returns at once ...
    measured = device.type == "cpu"                 # on a GPU the loop below only launches kernels
    in_flight = 0
    while measured and not handle.is_completed():   # ... so this thread computes meanwhile
        a = torch.tanh(a @ a)
        in_flight += 1
    handle.wait()
    return {"handle": type(handle).__name__, "blocking_result_ok": bool((blocking == want).all()),
            "async_result_ok": bool((x == want).all()), "device": device.type,
            "iterations_while_in_flight": in_flight if measured else None}
