"""The figures of the GPU check, and its one table (scripts/gpu_check.sh runs both).

    python scripts/gpu_check.py figures DIR NAME PART...   measure PART... (memory, steps, ...);
                                                           write DIR/figures-NAME.json after each
    python scripts/gpu_check.py table DIR                  print ONE markdown table of DIR

Every figure is one row: (section, figure, value, note). A part that needs a GPU prints a
"skipped: no GPU" row on a CPU machine instead of failing, so the script is tested on CPU too. A
part that raises is recorded as "FAILED: <error>" and the others still run. The shell script runs
the parts in stages of their own, each under its own timeout, and records each stage's outcome in
DIR/status.txt (section, stage, outcome, and the file of its rows, if any); the table is those
lines in order, each followed by its figures (a JSON list) or its tests (a JUnit XML file).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NO_GPU = "skipped: no GPU"


PARTS = ("machine", "numerics", "ceilings", "memory", "steps", "mfu_eager", "mfu_compiled",
         "profiled_step", "nccl_step", "equivalence", "hta", "async_tp", "tp_overlap")


def figures(out: Path, name: str, parts: list[str]) -> list[dict]:
    import torch

    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        sys.exit(f"unknown part(s) {unknown}: the parts are {', '.join(PARTS)}")
    rows: list[dict] = []
    gpu = torch.cuda.is_available()
    path = out / f"figures-{name}.json"

    def add(section, figure, value, note=""):
        rows.append({"section": section, "figure": figure, "value": value, "note": note})

    for part in parts:
        t0 = time.perf_counter()
        try:
            globals()[f"_{part}"](add, gpu, out)
        except Exception as e:  # recorded, and the remaining parts still run
            add(part, "FAILED", f"{type(e).__name__}: {e}".splitlines()[0][:200])
            traceback.print_exc()
        print(f"[gpu_check] {part}: {time.perf_counter() - t0:.1f} s", flush=True)
        # after each part: a stage stopped by its timeout keeps the rows of the parts it finished
        path.write_text(json.dumps(rows, indent=1, default=str))
    return rows


def _machine(add, gpu, out):
    from refimpl.lab.env import machine

    m = machine()
    (out / "env.json").write_text(json.dumps(m.as_dict(), indent=1))
    add("machine", "summary", m.summary(2))
    add("machine", "torch / CUDA / NCCL", f"{m.torch_version} / {m.cuda_version or '-'} / "
        f"{m.nccl_version or '-'}")
    for n in (1, 2, 4):
        add("machine", f"{n} rank(s) run on", m.where(n))
    if m.gpu_count == 1:
        add("machine", "NCCL path", "not run: NCCL needs one GPU per rank; multi-rank runs here "
            "stay on gloo (CPU), and their references run on CPU too")
    if m.interconnect:
        add("machine", "interconnect", "see env.json (nvidia-smi topo -m)")


def _numerics(add, gpu, out):
    import torch

    from refimpl.lab.env import numerics_settings
    from refimpl.lab.runtime import numerics

    if not gpu:
        add("numerics", "fp32 settings on CUDA", NO_GPU)
        return
    numerics.exact_fp32_on_cuda(torch.device("cuda", 0))
    add("numerics", "fp32 settings on CUDA", json.dumps(numerics_settings()))


def _ceilings(add, gpu, out):
    import torch

    from refimpl.lab.measure import ceilings
    add("ceilings", "memcpy, one CPU core (256 MiB)",
        f"{ceilings.memcpy_bandwidth(256 << 20) / 1e9:.2f} GB/s", "gloo ranks' ceiling")
    if not gpu:
        add("ceilings", "device-to-device copy", NO_GPU)
        return
    sweep = ceilings.copy_sweep("cuda", sizes=[1 << k for k in range(20, 33, 2)], repeats=5)
    sweep.to_csv(out / "d2d_copy_sweep.csv", index=False)
    best = sweep.loc[sweep.bytes_per_s.idxmax()]
    add("ceilings", "device-to-device copy, plateau",
        f"{best.bytes_per_s / 1e9:.0f} GB/s at {best.size_bytes / 2**20:.0f} MiB",
        f"copied bytes / s (HBM traffic is 2x); 1 MiB: {sweep.bytes_per_s.iloc[0] / 1e9:.0f} GB/s")
    if torch.cuda.device_count() >= 2:
        peer = ceilings.cuda_copy_bandwidth(1 << 30, 0, 1)
        add("ceilings", "peer copy GPU0->GPU1 (1 GiB)", f"{peer / 1e9:.0f} GB/s", "NCCL's ceiling")
    else:
        add("ceilings", "peer copy", "skipped: one GPU")
    add("ceilings", "sweep max size (gloo / nccl)",
        f"{ceilings.max_message_bytes('gloo') >> 20} MiB / {ceilings.max_message_bytes('nccl') >> 20} MiB")


def _memory(add, gpu, out):
    if not gpu:
        add("cuda memory", "memory_allocated vs arithmetic", NO_GPU)
        return
    from refimpl.lab.measure.cuda_memory import measure_model_states

    df = measure_model_states()
    df.to_csv(out / "cuda_memory.csv", index=False)
    for r in df.itertuples():
        if r.counted_bytes is not None and r.counted_bytes == r.counted_bytes:
            same = "==" if r.allocator_bytes == r.measured_bytes else "!="
            add("cuda memory", r.category,
                f"counted {int(r.counted_bytes):,} B; 512-B blocks {int(r.allocator_bytes):,} B "
                f"{same} memory_allocated {int(r.measured_bytes):,} B")
        else:
            add("cuda memory", r.category, f"{int(r.measured_bytes):,} B")


def _steps(add, gpu, out):
    from refimpl.lab.config import LabConfig
    from refimpl.train import train_on_ranks

    device = "cuda" if gpu else "cpu"
    res = {}
    for mp in ("fp32", "bf16"):
        r = train_on_ranks(LabConfig(steps=6, mixed_precision=mp, device=device))
        res[mp] = r
        add("steps", f"single, {mp}, {device}: median step",
            f"{r['step_time_s'] * 1e3:.2f} ms", f"losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    rel = max(abs(a - b) / b for a, b in zip(res["bf16"]["losses"], res["fp32"]["losses"]))
    add("steps", "bf16 vs fp32 loss, max rel. difference", f"{rel:.2e}", "expected < 1e-2")
    if gpu:   # the same fp32 run on the CPU: devices differ by round-off, not by the strategy
        cpu = train_on_ranks(LabConfig(steps=6, device="cpu"))
        rel = max(abs(a - b) / b for a, b in zip(res["fp32"]["losses"], cpu["losses"]))
        add("steps", "fp32 loss, GPU vs CPU, max rel. difference", f"{rel:.2e}",
            "TF32 off; not bit-exact across devices, which is why references run on the ranks' device")


def _mfu(add, gpu, compiled: bool):
    """Model FLOPs utilisation of a Llama 3.2 1B-shaped model (refimpl.lab.measure.mfu.LLAMA_3_2_1B) in
    bf16 on one GPU, eager or with each block compiled, beside torchtitan's (from its tokens/s). Two
    parts, so the eager row is kept if the compilation runs past the stage's time."""
    from refimpl.lab.measure import mfu
    label = "compiled blocks" if compiled else "eager"
    figure = f"Llama 3.2 1B shape, bf16, batch 2 x 2048, {label}: MFU"
    if not gpu:
        add("mfu", figure, NO_GPU)
        return
    r = mfu.measure(mfu.LLAMA_3_2_1B, batch_size=2, steps=8, device="cuda", compile=compiled)
    titan = {(t["mode"], t["GPUs"]): t["MFU"] for t in mfu.torchtitan_mfu()}
    add("mfu", figure, "n/a: no datasheet peak for this GPU" if r["mfu"] is None else f"{r['mfu']:.1%}",
        f"{r['achieved_flops'] / 1e12:.0f} TFLOP/s of {r['flops_per_token'] / 1e9:.2f} GFLOP/token, "
        f"{r['step_s'] * 1e3:.0f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, peak "
        f"{r['peak_memory_bytes'] / 2**30:.1f} GiB, first step {r['first_step_s']:.1f} s, loss "
        f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}; torchtitan, Llama 3.1 8B with FSDP on 8 H100s "
        f"(flash attention), MFU from its published tokens/s: {titan['compiled', 8]:.0%} compiled, "
        f"{titan['eager', 8]:.0%} eager")


def _mfu_eager(add, gpu, out):
    _mfu(add, gpu, compiled=False)


def _mfu_compiled(add, gpu, out):
    missing = toolchain_missing() if gpu else None
    if missing:
        add("mfu", "Llama 3.2 1B shape, bf16, batch 2 x 2048, compiled blocks: MFU",
            f"skipped: {missing}", "torch.compile's GPU kernels are Triton's, whose launcher is "
            "built from C on first use; the eager row above needs none of it")
        return
    _mfu(add, gpu, compiled=True)


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def python_include_dir() -> Path:
    """Where Triton looks for Python.h: the default install scheme's include folder (Debian's
    'posix_local' read as 'posix_prefix', as Triton reads it)."""
    import sysconfig

    scheme = sysconfig.get_default_scheme()
    return Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])


def toolchain_missing(include: Path | None = None) -> str | None:
    """Why inductor could not build Triton's launcher on this host, in one line, or None.

    Triton compiles a small C module (its launcher) with the host's compiler on first use: $CC,
    else gcc, else clang on PATH, with Python.h from `python_include_dir()`. An image without
    them fails at the first compiled step; this probe compiles a file that includes Python.h with
    that same compiler, in well under a second."""
    import shlex
    import shutil
    import subprocess
    import tempfile

    if not _has_triton():
        return "Triton is not installed (torch.compile's GPU backend)"
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("gcc") or shutil.which("clang") or ""]
    if not cc[0]:
        return "no host C compiler ($CC unset, no gcc or clang on PATH): Triton builds its launcher with one"
    if not shutil.which(cc[0]):
        return f"CC={os.environ.get('CC')!r} is not an executable: Triton builds its launcher with it"
    include = include or python_include_dir()
    if not (include / "Python.h").is_file():
        return f"no Python headers ({include}/Python.h; a python3-dev package): Triton's launcher includes them"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("#include <Python.h>\nint probe(void) { return Py_IsInitialized(); }\n")
        r = subprocess.run([*cc, "-c", str(src), f"-I{include}", "-o", str(Path(tmp) / "probe.o")],
                           capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[0][:160]
        return f"{cc[0]} cannot compile a file including Python.h: {why}"
    return None


def _profiled_step(add, gpu, out):
    from refimpl.lab import plots
    from refimpl.lab.config import LabConfig
    from refimpl.lab.trace import profiling
    from refimpl.train import train_on_ranks

    trace_dir = out / "trace-single"
    device = "cuda" if gpu else "cpu"
    train_on_ranks(LabConfig(steps=4, profile=True, trace_dir=str(trace_dir), device=device))
    df = profiling.load_trace(trace_dir)
    s = profiling.summarize(df).iloc[0]
    kernels = df[df.category.isin(["gpu", "gpu_comm"]) & df.step.notna()]
    add("profiled step", f"single on {device}: summary source", s.source,
        f"compute {s.compute_frac:.0%}, comm {s.comm_frac:.0%}, idle {s.idle_frac:.0%} of "
        f"{s.steps} step(s), {s.step_us / max(s.steps, 1) / 1e3:.2f} ms each")
    if gpu:
        labelled = kernels.label.notna().mean() if len(kernels) else 0.0
        add("profiled step", "GPU kernels in the profiled steps",
            f"{len(kernels)} ({labelled:.0%} matched to a CPU label)",
            "by label: " + ", ".join(f"{k} {v}" for k, v in
                                     kernels.label.fillna("-").value_counts().head(4).items()))
        # Issue 35's defect 4: autograd launches backward's kernels from its own device thread,
        # while the backward phase is open on the main thread. Every kernel launched while a
        # backward range is open (on any thread) must carry a label, and most of them "backward".
        phases = df[(df.name == "backward") & df.step.notna()]
        inside = kernels[[any(p.start_us <= k < p.start_us + p.dur_us for p in phases.itertuples())
                          for k in kernels.launch_us]]
        add("profiled step", "kernels launched inside backward",
            f"{len(inside)} in {len(phases)} backward range(s): "
            f"{inside.label.notna().mean() if len(inside) else 0:.0%} labelled, "
            f"{(inside.label == 'backward').mean() if len(inside) else 0:.0%} 'backward'",
            "FAILED: some unlabelled" if len(inside) and inside.label.isna().any() else
            ("FAILED: none found" if not len(inside) else "every one labelled (issue 35)"))
    else:
        add("profiled step", "GPU kernels in the profiled steps", NO_GPU)
        add("profiled step", "kernels launched inside backward", NO_GPU)
    fig = plots.rank_timeline(df[df.step == df.step.dropna().min()], title=f"single on {device}")
    lanes = sorted({y for t in fig.data for y in t.y})
    fig.write_html(out / "rank_timeline.html", include_plotlyjs=True)
    add("profiled step", "rank timeline lanes", ", ".join(lanes), "rank_timeline.html")


def _nccl_step(add, gpu, out):
    """dp on 2 ranks over NCCL, profiled: NCCL kernels beside compute kernels (>= 2 GPUs only)."""
    import torch

    from refimpl.lab.config import LabConfig
    from refimpl.lab.trace import profiling
    from refimpl.train import train_on_ranks

    if not gpu or torch.cuda.device_count() < 2:
        add("NCCL", "dp, 2 ranks, profiled", "skipped: NCCL needs one GPU per rank (>= 2 GPUs)")
        return
    trace_dir = out / "trace-dp-nccl"
    train_on_ranks(LabConfig(strategy="dp", nproc=2, steps=4, profile=True,
                             trace_dir=str(trace_dir), options={"bucket_mb": 0.25}))
    df = profiling.load_trace(trace_dir)
    s = profiling.summarize(df)
    nccl = df[(df.category == "gpu_comm") & df.step.notna()]
    add("NCCL", "dp, 2 ranks: NCCL kernels per rank", str(nccl.groupby("rank").size().to_dict()),
        f"summary source: {', '.join(sorted(set(s.source)))}")
    add("NCCL", "dp, 2 ranks: comm hidden under compute",
        ", ".join(f"rank {r.rank} {r.comm_hidden_frac:.0%}" for r in s.itertuples()))
    table = profiling.comm_table(df)
    if not table.empty:
        add("NCCL", "dp collectives, bandwidth over NCCL kernel time",
            ", ".join(f"rank {r.rank} {r.op} {r.GB_per_s:.1f} GB/s" for r in table.itertuples()))


def _equivalence(add, gpu, out):
    from refimpl.lab.config import LabConfig
    from refimpl.lab.env import machine
    from refimpl.lab.verify.equivalence import compare_with_single, ranks_device

    eq = compare_with_single(LabConfig(strategy="dp", nproc=2, steps=3))
    add("equivalence", f"dp, 2 ranks on {machine(topology=False).where(2)}, reference on "
        f"{ranks_device(2)}", f"loss {eq.loss_rel_err:.1e}, weights {eq.weight_rel_err:.1e}",
        f"tolerance 1e-5: {'ok' if eq.ok else 'FAILED'}")


def _async_tp_rank(rank, world):
    """PyTorch's async TP on one rank: fused all-gather + matmul over symmetric memory, against
    the plain all-gather then matmul (refimpl's own ring twin: refimpl.lab.tensor.ring)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    device = torch.device("cuda", rank % torch.cuda.device_count())   # this rank's own GPU
    torch.cuda.set_device(device)
    group = dist.group.WORLD
    enable_symm_mem_for_group(group.group_name)
    torch.manual_seed(rank)
    shard = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    gathered = torch.empty(world * 4096, 4096, device=device, dtype=torch.bfloat16)

    def plain():
        dist.all_gather_into_tensor(gathered, shard)
        return gathered @ weight

    def fused():
        return torch.ops.symm_mem.fused_all_gather_matmul(shard, [weight], gather_dim=0,
                                                          group_name=group.group_name)[1][0]

    times = {}
    for name, fn in (("plain", plain), ("fused", fused)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            y = fn()
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - start) / 10
        times[f"{name}_y"] = y.float().norm().item()
    return times


def _async_tp(add, gpu, out):
    """PyTorch's async TP (torch.distributed._symmetric_memory, CUDA only): it cannot run on CPU
    ranks, so refimpl's own `--set tp_overlap=true` is the CPU form; here, with >= 2 GPUs, the
    fused all-gather + matmul against the plain pair, in one launch over NCCL."""
    import torch

    from refimpl import launch

    if not gpu or torch.cuda.device_count() < 2:
        add("async TP", "fused all-gather + matmul, 2 ranks", "skipped: needs >= 2 GPUs (NCCL, "
            "symmetric memory)")
        return
    r = launch.run(_async_tp_rank, 2, backend="nccl", timeout=300)[0]
    same = abs(r["fused_y"] - r["plain_y"]) <= 1e-2 * abs(r["plain_y"])
    add("async TP", "fused / plain all-gather + matmul time, 2 ranks, bf16 4096²",
        f"{r['fused'] / r['plain']:.3f}", f"outputs agree: {'ok' if same else 'FAILED'}")


def _tp_overlap(add, gpu, out):
    """refimpl's `--set tp_overlap=true` against tp + SP on 2 ranks, beside the α-β model's saving
    with this machine's σ (refimpl.lab.predict.tp_comm.transfer_engine_share) and σ measured
    (tp_overlap.transfer_beside_matmul). The ranks are wherever 2 ranks run here: CPU ranks on
    gloo with one GPU, whose host has cores to spare (σ = 1), or 2 GPUs on NCCL. That is the case
    this project's 2-core machines cannot show: there σ = 0 and the model predicts no saving."""
    from refimpl.lab.verify import tp_overlap
    from refimpl.launch import pick_backend

    m = tp_overlap.measure(2, *tp_overlap.hop_model_here(2), steps=6, rounds=3, global_batch=8, seq_len=32)
    plain, ring = m["steps"]["tp+SP"], m["steps"]["tp_overlap"]
    beside = tp_overlap.transfer_beside_matmul()
    where = pick_backend(2)
    add("tp_overlap", f"σ on 2 ranks ({where}): the model / measured (both multiply, one)",
        f"{m['engine_share']:.2f} / {beside['both multiply']:.2f}, {beside['one multiplies']:.2f}")
    add("tp_overlap", "tp_overlap / tp (SP) step time, 2 ranks", f"{ring / plain:.3f}",
        f"saving predicted {m['predicted_saving_s'] * 1e3:.1f} ms of {plain * 1e3:.1f} ms "
        f"({m['saving_if_free_s'] * 1e3:.1f} ms with σ = 1), measured {(plain - ring) * 1e3:.1f} ms")


def _hta(add, gpu, out):
    """HolisticTraceAnalysis, only where it is installed (optional: scripts/gpu_wheels_optional.txt)."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        add("HTA", "comm/comp overlap", "skipped: HolisticTraceAnalysis not installed")
        return
    from refimpl.lab.trace import profiling
    from tests.test_gpu_trace import _trace

    synthetic = out / "trace-synthetic"
    synthetic.mkdir(exist_ok=True)
    (synthetic / "rank0.1.pt.trace.json").write_text(json.dumps(_trace()))
    theirs = TraceAnalysis(trace_dir=str(synthetic)).get_comm_comp_overlap(visualize=False)
    ours = profiling.summarize(profiling.load_trace(synthetic)).iloc[0].comm_hidden_frac
    add("HTA", "comm/comp overlap, synthetic CUDA trace",
        f"HTA {theirs.comp_comm_overlap_pctg.iloc[0]:.2f}% vs ours {100 * ours:.2f}%")
    if not gpu:
        add("HTA", "comm/comp overlap, a real CUDA trace", NO_GPU)
        return
    real = out / "trace-dp-nccl"
    if not real.exists():
        add("HTA", "comm/comp overlap, a real CUDA trace",
            "not run: NCCL kernels need >= 2 GPUs (one per rank); on one GPU the ranks run on gloo")
        return
    # HTA reads every *.json of its folder as a rank's trace: hand it the rank traces alone, not
    # the run_summary.json beside them
    traces = profiling.rank_traces_only(real, out / "trace-dp-nccl-ranks")
    theirs = TraceAnalysis(trace_dir=str(traces)).get_comm_comp_overlap(visualize=False)
    ours = profiling.summarize(profiling.load_trace(real)).set_index("rank").comm_hidden_frac
    add("HTA", "comm/comp overlap, dp on 2 GPUs (NCCL)", ", ".join(
        f"rank {r.rank}: HTA {r.comp_comm_overlap_pctg:.1f}% vs ours {100 * ours[r.rank]:.1f}%"
        for r in theirs.itertuples()))


def _junit_rows(path: Path, section: str) -> list[dict]:
    """One row per test case of a JUnit XML file (pytest --junitxml): passed, FAILED or skipped."""
    import xml.etree.ElementTree as ET

    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        outcome, note = "passed", ""
        for child in case:
            message = (child.get("message") or "").strip()
            first = message.splitlines()[0][:160] if message else ""
            if child.tag in ("failure", "error"):
                outcome, note = "FAILED", first
            elif child.tag == "skipped":
                outcome, note = "skipped", first
        rows.append({"section": section, "figure": f"  {name}", "value": outcome,
                     "note": note or f"{float(case.get('time', 0)):.1f} s"})
    return rows


def table(out: Path) -> str:
    """status.txt's lines in order, each followed by the rows of the file it names, if any."""
    status = (out / "status.txt").read_text().splitlines() if (out / "status.txt").exists() else []
    rows = []
    for line in status:
        section, figure, value, attached = (line.split("\t") + ["", "", "", ""])[:4]
        rows.append({"section": section, "figure": figure, "value": value, "note": ""})
        path = out / attached if attached else None
        if path is None or not path.is_file():
            continue
        try:
            rows += (json.loads(path.read_text()) if path.suffix == ".json"
                     else _junit_rows(path, section))
        except Exception as e:   # a file cut short by a timeout: say so, keep the rest
            rows.append({"section": section, "figure": attached, "value": f"unreadable: {e}",
                         "note": ""})
    lines = ["| section | figure | value | note |", "|---|---|---|---|"]
    for r in rows:
        cells = [str(r[k]).replace("|", "\\|").replace("\n", " ") for k in
                 ("section", "figure", "value", "note")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    cmd, out_dir = sys.argv[1], Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    if cmd == "figures":
        figures(out_dir, sys.argv[3], sys.argv[4:])
    elif cmd == "table":
        print(table(out_dir))
    else:
        sys.exit(f"unknown command {cmd!r}: figures or table")
