"""Labels and byte counts do not depend on the thread that runs backward (issue 35, defect 4).

On CUDA, autograd runs backward on its own device thread: the gradient hooks that launch a
data-parallel bucket's all-reduce and the MoE layer's backward all-to-all run there, while
`phase("backward")`, the open `CommLog` and the pipeline's `pp:B` ranges belong to the main
thread. On CPU autograd runs backward on the calling thread, so these tests move it to another
thread themselves (a `threading.Thread`, like autograd's) and ask for the same labels and bytes
as on the main thread: in the CommLog and the flight recorder (real collectives on two gloo
ranks), and in a CUDA-shaped trace (synthetic, and a real DDP trace whose backward kernels are
launched from autograd's thread).
"""
import gzip
import json
import threading
from pathlib import Path

import pytest

from refimpl.lab.runtime.tools import watching
from refimpl.lab.trace import profiling
from refimpl.launch import run


def _one_backward(rank: int, world_size: int, on_thread: bool) -> dict:
    """A bucketed DP all-reduce (gradient hooks) and an MoE all-to-all (an autograd Function's
    backward), both through refimpl.comm's counted collectives; backward on this thread or on
    another one while this thread holds the phase and the log."""
    import os
    from functools import partial

    import torch
    import torch.distributed as dist

    import refimpl.comm as comm
    from refimpl.lab.instrument.labels import CommLog, phase
    from refimpl.lab.runtime import flight_recorder
    from refimpl.parallel.dp.flat_param import FlatParams
    from refimpl.parallel.dp.grad_buckets import GradBuckets, all_reduce_sum
    from refimpl.parallel.ep.dispatch import AllToAll
    from refimpl.seam import use_collectives

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    layout = FlatParams(list(model.named_parameters()), world_size)
    use_collectives(comm)       # every collective below through refimpl.comm's, counted
    buckets = GradBuckets(layout, 64 * 4, reduce=partial(all_reduce_sum, group=dist.group.WORLD))
    buckets.attach(layout.empty())
    x = torch.randn(2 * world_size, 8) + rank
    moved = AllToAll.apply(model(x), dist.group.WORLD, "dispatch")
    loss = moved.square().sum()
    errors = []

    def backward():
        try:
            loss.backward()
        except BaseException as e:   # a thread's exception would otherwise vanish
            errors.append(e)

    seen_before = len(flight_recorder.read(os.environ[flight_recorder.ENV], rank))
    with CommLog() as log, phase("backward"):
        with buckets.micro_step(sync=True):
            if on_thread:
                worker = threading.Thread(target=backward)
                worker.start()
                worker.join()
            else:
                backward()
        buckets.wait()
    if errors:
        raise errors[0]
    recorded = flight_recorder.read(os.environ[flight_recorder.ENV], rank)[seen_before:]
    return {"calls": log.calls, "sent": dict(log.sent), "received": dict(log.received),
            "messages": dict(log.messages),
            "recorded": [(r["op"], r["bytes"], r["phase"]) for r in recorded if r["op"] != "wait"],
            "grad": buckets.flat_grad.clone()}


def _both(rank: int, world_size: int) -> dict:
    return {"main": _one_backward(rank, world_size, False),
            "thread": _one_backward(rank, world_size, True)}


@pytest.mark.ranks
def test_a_backward_on_another_thread_is_labelled_and_counted_in_full():
    with watching(flight_recorder=True):
        per_rank = run(_both, 2, quiet=True)
    for out in per_rank:
        main, thread = out["main"], out["thread"]
        assert {c["op"] for c in main["calls"]} >= {"all_reduce", "all_to_all"}
        assert main["sent"]["all_reduce"] > 0 and main["sent"]["all_to_all"] > 0
        for key in ("calls", "sent", "received", "messages"):
            assert thread[key] == main[key], key
        # the flight recorder names the phase the main thread holds, for the worker's calls too
        assert thread["recorded"] == main["recorded"] and thread["recorded"]
        assert {p for _, _, p in thread["recorded"]} <= {"backward", "moe:dispatch.backward"}
        assert thread["grad"].equal(main["grad"])


# --- the trace: kernels launched on a thread that opened none of the ranges ----------------------

MAIN, AUTOGRAD, LANE, COMPUTE, NCCL = 11, 12, 13, 7, 20


def _x(name, ts, dur, tid, cat="user_annotation", pid=1, **args):
    ev = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    if args:
        ev["args"] = args
    return ev


def _launch(ts, tid, corr, kernel, start, dur):
    stream = NCCL if kernel.startswith("nccl") else COMPUTE
    return [_x("cudaLaunchKernel", ts, 2, tid, cat="cuda_runtime", correlation=corr),
            _x(kernel, start, dur, stream, cat="kernel", pid=0, correlation=corr, device=0,
               stream=stream)]


def _threaded_trace() -> dict:
    """A step whose backward and pp:B0 are open on the main thread (400-900 µs) while autograd's
    thread launches the backward's kernels: two compute kernels, and inside a gradient hook's
    comm:all_reduce (600-620) an NCCL kernel; meanwhile an async lane thread's comm:all_reduce
    (650-700) launches another."""
    events = [_x("ProfilerStep#1", 0, 1000, MAIN), _x("forward", 0, 400, MAIN),
              _x("backward", 400, 500, MAIN), _x("pp:B0", 410, 480, MAIN),
              _x("comm:all_reduce 4096B", 600, 20, AUTOGRAD),
              _x("comm:all_reduce 8192B", 650, 50, LANE)]
    events += _launch(10, MAIN, 1, "ampere_sgemm_128x64_tn", 20, 100)
    events += _launch(450, AUTOGRAD, 2, "ampere_sgemm_128x64_nt", 460, 100)
    events += _launch(605, AUTOGRAD, 3, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 610, 50)
    events += _launch(660, LANE, 4, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 670, 80)
    events += _launch(680, AUTOGRAD, 5, "void at::native::vectorized_elementwise_kernel<4>", 690, 30)
    return {"baseTimeNanoseconds": 1_000_000_000, "traceEvents": events}


def test_kernels_launched_from_autograds_thread_carry_the_main_threads_labels(tmp_path):
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(_threaded_trace()))
    df = profiling.load_trace(tmp_path, include_ops=True)
    gpu = df[df.category.isin(["gpu", "gpu_comm"])].set_index("start_us")
    assert gpu.label.to_dict() == {20.0: "forward", 460.0: "backward",
                                   610.0: "comm:all_reduce 4096B",
                                   670.0: "comm:all_reduce 8192B", 690.0: "backward"}
    # the action's GPU time: its compute kernels, whichever thread launched them (460 to 720)
    b0 = df[df.name == "pp:B0"].iloc[0]
    assert (b0.gpu_start_us, b0.gpu_start_us + b0.gpu_dur_us) == (460.0, 720.0)
    # every byte: both all-reduces in the comm table, each timed by its own NCCL kernel
    table = profiling.comm_table(df).set_index("op")
    assert (table.loc["all_reduce", "count"], table.loc["all_reduce", "bytes"],
            table.loc["all_reduce", "time_us"]) == (2, 4096 + 8192, 50 + 80)


REAL = Path(__file__).parent / "data" / "hta_nccl"   # a real 2-GPU DDP trace (its README.md)


def test_a_real_ddp_backward_launched_from_autograds_thread_is_labelled(tmp_path):
    # The real trace names its phases "## backward ##" on the main thread; renamed to ours, every
    # kernel launched inside a backward, on whichever thread, gets a label.
    raw = profiling.read_trace(REAL / "rank0.pt.trace.json.gz")
    for ev in raw["traceEvents"]:
        if ev.get("name") in ("## forward ##", "## backward ##"):
            ev["name"] = ev["name"].strip("# ")
    with gzip.open(tmp_path / "rank0.pt.trace.json.gz", "wt") as f:
        json.dump(raw, f)
    df = profiling.load_trace(tmp_path)
    phases = df[df.name == "backward"]
    assert len(phases) == 3
    main_thread = phases.thread.iloc[0]
    kernels = df[df.category.isin(["gpu", "gpu_comm"])]
    inside = kernels[[any(p.start_us <= k < p.start_us + p.dur_us for p in phases.itertuples())
                      for k in kernels.launch_us]]
    launched_elsewhere = inside[inside.label != "backward"]
    assert len(inside) > 100 and inside.label.notna().all()
    # most are launched from autograd's thread and labelled by the main thread's phase; those
    # that are not are DDP's all-reduces, labelled by the range open on their own thread
    assert (inside.label == "backward").mean() > 0.5
    assert launched_elsewhere.label.str.startswith("nccl:").all()
    assert (phases.thread == main_thread).all()


def test_logs_open_on_two_threads_close_in_either_order():
    # Seen from a thread with nothing open (autograd's): the logs open anywhere, innermost last;
    # one closing first on another thread leaves the other open.
    from refimpl.lab.instrument.labels import CommLog, open_logs

    a_open, b_open, a_closed, b_close = (threading.Event() for _ in range(4))
    logs = {}

    def hold(name, opened, wait_for, close_when):
        with CommLog() as log:
            logs[name] = log
            opened.set()
            close_when.wait(5)
        wait_for.set()

    def seen():
        out = []
        t = threading.Thread(target=lambda: out.append(open_logs()))
        t.start()
        t.join()
        return out[0]

    release_a = threading.Event()
    ta = threading.Thread(target=hold, args=("a", a_open, a_closed, release_a))
    ta.start()
    a_open.wait(5)
    tb = threading.Thread(target=hold, args=("b", b_open, threading.Event(), b_close))
    tb.start()
    b_open.wait(5)
    assert seen() == (logs["a"], logs["b"])
    release_a.set()
    a_closed.wait(5)
    ta.join()
    assert seen() == (logs["b"],)
    b_close.set()
    tb.join()
    assert seen() == () and open_logs() == ()
