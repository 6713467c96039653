"""The CUDA reading of a trace, on a small synthetic CUDA-style Chrome trace (runs on any machine).

One profiled step of 1000 µs on the CPU: forward (0-400), comm:all_reduce (400-450) and backward
(450-900) launch three kernels; on the GPU a GEMM runs 100-300, the NCCL all-reduce 430-730 and an
elementwise kernel 500-600. So the GPU computes 300 µs, communicates 300 µs, 100 µs of them at
once, and idles 500 µs -- while the CPU ranges alone would say the comm took 50 µs, never hidden.
"""
import functools
import json
from pathlib import Path

import pytest

from refimpl.lab.trace import kernels, profiling

CPU_TID, COMPUTE_STREAM, NCCL_STREAM = 11, 7, 20


def _x(name, ts, dur, tid, cat="user_annotation", pid=1, **args):
    ev = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    if args:
        ev["args"] = args
    return ev


def _trace():
    return {"baseTimeNanoseconds": 1_000_000_000,
            "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
            "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}], "traceEvents": [
        _x("ProfilerStep#1", 0, 1000, CPU_TID),
        _x("forward", 0, 400, CPU_TID),
        _x("comm:all_reduce 4096B", 400, 50, CPU_TID),
        _x("backward", 450, 450, CPU_TID),
        _x("cudaLaunchKernel", 10, 5, CPU_TID, cat="cuda_runtime", correlation=1),
        _x("cudaLaunchKernel", 420, 5, CPU_TID, cat="cuda_runtime", correlation=2),
        _x("cudaLaunchKernel", 460, 5, CPU_TID, cat="cuda_runtime", correlation=3),
        _x("sm90_xmma_gemm_f32f32_tf32f32_f32_nn", 100, 200, COMPUTE_STREAM, cat="kernel", pid=0,
           correlation=1, device=0, stream=COMPUTE_STREAM),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 430, 300,
           NCCL_STREAM, cat="kernel", pid=0, correlation=2, device=0, stream=NCCL_STREAM),
        _x("void at::native::vectorized_elementwise_kernel<4>", 500, 100, COMPUTE_STREAM,
           cat="kernel", pid=0, correlation=3, device=0, stream=COMPUTE_STREAM),
        {"ph": "s", "id": 2, "pid": 1, "tid": CPU_TID, "ts": 420, "cat": "ac2g", "name": "ac2g"},
    ]}


@pytest.fixture
def run(tmp_path):
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(_trace()))
    return tmp_path


def test_kernels_are_read_labelled_and_stepped(run):
    df = profiling.load_trace(run)
    gpu = df[df.category.isin(["gpu", "gpu_comm"])].set_index("start_us")
    assert gpu.category.to_dict() == {100.0: "gpu", 430.0: "gpu_comm", 500.0: "gpu"}
    assert gpu.label.to_dict() == {100.0: "forward", 430.0: "comm:all_reduce 4096B",
                                   500.0: "backward"}
    assert (gpu.step == 1).all()


def test_summary_reads_the_gpu_streams_on_a_cuda_trace(run):
    row = profiling.summarize(profiling.load_trace(run)).iloc[0]
    assert row.source == "gpu kernels"
    assert (row.compute_us, row.comm_us, row.overlap_us, row.idle_us) == (200, 200, 100, 500)
    assert row.comm_hidden_frac == pytest.approx(1 / 3)


def test_the_same_trace_without_kernels_is_read_from_cpu_ranges(tmp_path):
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") != "kernel"]
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(trace))
    row = profiling.summarize(profiling.load_trace(tmp_path)).iloc[0]
    assert row.source == "cpu ranges"
    assert (row.compute_us, row.comm_us, row.overlap_us, row.idle_us) == (850, 50, 0, 100)


def test_comm_table_times_the_nccl_kernel_not_the_launch(run):
    t = profiling.comm_table(profiling.load_trace(run)).iloc[0]
    assert (t.op, t["count"], t.bytes, t.time_us) == ("all_reduce", 1, 4096, 300)


def test_busy_split_handles_windows_and_nesting():
    split = kernels.split_busy_time([(0, 10), (5, 20)], [(15, 30)], [(2, 25), (40, 50)])
    assert split == {"compute": 13.0, "comm": 5.0, "overlap": 5.0, "idle": 10.0}
    assert kernels.kernel_category("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t") == "gpu_comm"
    assert kernels.kernel_category("ampere_sgemm_128x64_tn") == "gpu"


def test_timelines_draw_the_kernels_in_a_gpu_lane(run):
    from refimpl.lab import plots
    from refimpl.lab.trace import views

    df = profiling.load_trace(run)
    spans = views.timeline(df, views.StepWindow(1, 1))["spans"]
    assert {s["row"] for s in spans} >= {"gpu", "gpu comm", "compute", "comm"}
    fig = plots.rank_timeline(df)
    lanes = {y for trace in fig.data for y in trace.y}
    assert lanes == {"rank 0", "rank 0 GPU"}


def test_holistic_trace_analysis_agrees_where_installed(run):
    # Optional: HolisticTraceAnalysis (scripts/gpu_wheels_optional.txt) reads the same kernels.
    hta = pytest.importorskip("hta.trace_analysis")
    theirs = hta.TraceAnalysis(trace_dir=str(run)).get_comm_comp_overlap(visualize=False)
    ours = profiling.summarize(profiling.load_trace(run)).iloc[0].comm_hidden_frac
    assert theirs.comp_comm_overlap_pctg.iloc[0] == pytest.approx(100 * ours, abs=0.01)


REAL = Path(__file__).parent / "data" / "hta_nccl"   # a real 2-GPU DDP trace (its README.md)


def test_a_real_cuda_trace_gives_one_row_per_label():
    raw = profiling.read_trace(REAL / "rank0.pt.trace.json.gz")["traceEvents"]
    on_cpu = [e for e in raw if e.get("cat") == "user_annotation" and e["name"] == "nccl:all_reduce"]
    on_gpu = [e for e in raw if e.get("cat") == "gpu_user_annotation" and e["name"] == "nccl:all_reduce"]
    assert len(on_cpu) == len(on_gpu) > 0          # Kineto writes each range on both timelines
    df = profiling.load_trace(REAL)
    comm = df[df.category == "comm"]
    assert (comm.name == "nccl:all_reduce").sum() == len(on_cpu)      # read once: the CPU range
    assert (df.category == "step").sum() == sum(e["name"].startswith("ProfilerStep#") for e in raw)
    nccl = [e for e in raw if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel")]
    assert (df.category == "gpu_comm").sum() == len(nccl)
    row = profiling.summarize(df).iloc[0]
    assert row.source == "gpu kernels"
    # The communication time is the NCCL kernels' union inside the profiled steps (hidden or
    # not), counted here from the raw events: no CPU range is read as GPU time.
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in raw
             if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    inside = [(max(e["ts"], a), min(e["ts"] + e["dur"], b)) for e in nccl for a, b in steps
              if min(e["ts"] + e["dur"], b) > max(e["ts"], a)]
    assert abs(row.comm_us + row.overlap_us - _union(inside)) < 0.1
    assert abs(row.compute_us + row.comm_us + row.overlap_us + row.idle_us - row.step_us) < 0.1


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def test_a_label_gets_the_gpu_time_of_its_kernels_as_kineto_draws_it():
    # Kineto's own reading of the same question: a gpu_user_annotation event per range and GPU
    # stream. Ours comes from the correlation ids (kernels.gpu_spans); on this real trace every
    # collective's span must match Kineto's, one for one, up to a constant shift (the loader's
    # time origin) and the 1.5 µs Kineto pads each annotation with in this trace.
    raw = profiling.read_trace(REAL / "rank0.pt.trace.json.gz")["traceEvents"]
    df = profiling.load_trace(REAL)
    for name in ("nccl:all_reduce", "nccl:broadcast"):
        kineto = sorted((e["ts"], e["dur"]) for e in raw
                        if e.get("cat") == "gpu_user_annotation" and e["name"] == name)
        ours = df[df.name == name].sort_values("start_us")
        assert len(ours) == len(kineto) and ours.gpu_start_us.notna().all()
        shifts = [k[0] - g for k, g in zip(kineto, ours.gpu_start_us)]
        assert max(shifts) - min(shifts) < 1e-3
        pads = [k[1] - d for k, d in zip(kineto, ours.gpu_dur_us)]
        assert all(0 <= p < 2 for p in pads)
    # the CPU range is far longer than its kernels on the GPU: reading it as GPU time would be wrong
    comm = df[df.name == "nccl:all_reduce"]
    assert (comm.dur_us != comm.gpu_dur_us).all()


def test_pipeline_actions_are_read_off_the_gpu_on_a_cuda_trace(run):
    # One action launching a GEMM (100-300 µs on the GPU) inside a CPU range of 0-400 µs:
    # on CUDA the slot is the kernel's time; without kernels, the range's.
    from refimpl.lab.measure.pp_measure import action_slots

    trace = _trace()
    trace["traceEvents"].append(_x("pp:F0", 0, 400, CPU_TID))
    (run / "rank0.1.pt.trace.json").write_text(json.dumps(trace))
    slots = action_slots(profiling.load_trace(run, include_ops=True))
    assert slots.attrs["clock"] == "gpu kernels"
    assert (slots.start.iloc[0], slots.end.iloc[0]) == (0.0, 0.2)       # ms from the first action
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") != "kernel"]
    (run / "rank0.1.pt.trace.json").write_text(json.dumps(trace))
    slots = action_slots(profiling.load_trace(run, include_ops=True))
    assert slots.attrs["clock"] == "cpu ranges" and slots.end.iloc[0] == 0.4


def _staged_trace():
    """A staged run on cuda:0 (refimpl.lab.runtime.shared_device): one step of 1000 µs; the batch goes up
    (HtoD at 0-5), forward's GEMM runs 100-300, the all-reduce copies its bucket to the host
    (DtoH 410-430) and back (HtoD 685-700) inside the backend's `staged:copy` ranges, with gloo on
    the host between them, and backward's kernel runs 750-850. No NCCL kernel anywhere."""
    launch = functools.partial(_x, "cudaLaunchKernel", dur=2, tid=CPU_TID, cat="cuda_runtime")
    memcpy = functools.partial(_x, tid=COMPUTE_STREAM, cat="gpu_memcpy", pid=0, device=0)
    return {"baseTimeNanoseconds": 1_000_000_000, "traceEvents": [
        _x("ProfilerStep#1", 0, 1000, CPU_TID),
        _x("forward", 0, 400, CPU_TID),
        _x("comm:all_reduce 4096B", 400, 300, CPU_TID),
        _x(kernels.STAGING_COPY, 400, 20, CPU_TID),
        _x(kernels.STAGING_COPY, 680, 20, CPU_TID),
        _x("backward", 700, 200, CPU_TID),
        launch(ts=0, correlation=5), launch(ts=10, correlation=1), launch(ts=405, correlation=2),
        launch(ts=682, correlation=3), launch(ts=710, correlation=4),
        memcpy("Memcpy HtoD (Pageable -> Device)", 0, 5, correlation=5),
        _x("sm90_xmma_gemm_f32f32_tf32f32_f32_nn", 100, 200, COMPUTE_STREAM, cat="kernel", pid=0,
           correlation=1, device=0),
        memcpy("Memcpy DtoH (Device -> Pageable)", 410, 20, correlation=2),
        memcpy("Memcpy HtoD (Pageable -> Device)", 685, 15, correlation=3),
        _x("void at::native::vectorized_elementwise_kernel<4>", 750, 100, COMPUTE_STREAM,
           cat="kernel", pid=0, correlation=4, device=0),
    ]}


def test_the_staged_backends_copies_are_its_communication(tmp_path):
    """On a GPU the staged backend's only device work is its copies: read as compute, a staged
    run's communication would be 0 % of its step."""
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(_staged_trace()))
    df = profiling.load_trace(tmp_path)
    gpu = df[df.category.isin(["gpu", "gpu_comm"])].set_index("start_us")
    assert gpu.category.to_dict() == {0.0: "gpu", 100.0: "gpu", 410.0: "gpu_comm",
                                      685.0: "gpu_comm", 750.0: "gpu"}
    (row,) = profiling.summarize(df).itertuples()
    assert row.source == "gpu kernels"
    assert (row.comm_us, row.compute_us, row.overlap_us) == (35.0, 305.0, 0.0)
    # the bandwidth table times the call (blocking on a GPU: copies and gloo), not the copies
    (op,) = profiling.comm_table(df).itertuples()
    assert (op.op, op.bytes, op.time_us) == ("all_reduce", 4096, 300.0)
