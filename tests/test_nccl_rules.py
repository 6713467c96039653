"""NCCL's rules that gloo forgives, checked on gloo, on the same runs:

* **One tag.** NCCL ignores tags and pairs the messages between two ranks in the order they were
  posted; gloo pairs them by tag, so a posting order that NCCL would pair wrongly can pass here
  unseen. Under REFIMPL_P2P_TAGS=one (refimpl.lab.runtime.one_tag) every message carries tag 0 and
  gloo pairs them by posting order, as NCCL does. Every pipeline schedule (interleaved, whose
  chunks talk to the same neighbour in both directions, included), ring attention (over tp heads
  too) and the rebuilt collectives must then still equal `single` at float64's gate: a wrong pairing gives another
  tensor (an error far above 1e-9) or a hang (the launcher's timeout).
* **Every call through a device-checking backend.** The runs use the staged backend
  (refimpl.lab.runtime.shared_device, REFIMPL_SHARED_DEVICE=cpu here): each collective and message checks that
  its tensors are on the rank's device and goes through gloo on host copies. On a GPU machine
  scripts/gpu_check.sh runs this file with REFIMPL_SHARED_DEVICE=cuda:0: several ranks on one GPU,
  every tensor on it, which NCCL itself cannot do (one rank per GPU).
* **NCCL's stream order.** The staged backend runs each group's operations one at a time in
  posting order, a send completing only once the peer's receive has started
  (refimpl.lab.runtime.staged_stream), so a posting order that would hang on NCCL hangs in these runs too,
  and fails at the stream's timeout naming the blocked operation: the pipeline's old one-ahead
  posting does (`test_the_strict_stream_hangs_the_old_posting...`), every run below does not.
  Not only the training loop: the notebooks' own helpers and the bench scripts' ranks run on a
  staged world too (`staged_launch`); the pipeline helper of notebook 07 hung there before. The
  training variants that notebooks 03-06, 08 and 09 and scripts/bench_{dp,fsdp,tp,composition}.py
  run (bucket sizes, FSDP's modes and offload, checkpointing, MoE capacity and balancing, the
  twins) are in RUNS, and so is Llama's block (--arch llama: one key/value head shared by the tp
  ranks under SP; rotary positions under ring attention).
* **bf16, the profiler, memory recording, a fault** (`extras`, in RUNS[2]'s staged launch).
  BF16's runs (fsdp: bf16 all-gathers, fp32 reduce-scatters; tp + SP: bf16 all-gathers,
  reduce-scatters and all-reduces; 1F1B: fp32 sends and receives, the residual stream; ring
  attention: bf16 sends and receives under one tag) keep NCCL's rules in bf16 and equal the same
  runs on plain gloo (`gloo_launch`) bit for bit (on the GPU check's cuda:0, within bf16's
  gate: its matmuls are the GPU's); `full` runs every layout of RUNS in bf16 so. The tp + SP
  one is profiled (--profile: the same `comm:` labels, step for step, as gloo's trace) and the
  fsdp one records memory (record_memory: a peak on every rank). Notebook 10's skip-grad-sync
  is found by the comparison with `single` (the last block's weights, exactly); the bisector on
  the staged backend is `full` (a launch of its own).
* **NCCL's argument rules.** The staged backend also refuses a non-contiguous tensor, a dtype
  NCCL has no type for and a reduce op it lacks (refimpl.lab.runtime.shared_device), so every run here keeps
  them; notebook 01's comparison handed torch a transposed tensor before.
* **The rank's device.** On a GPU server torch's default device stays the CPU while a rank computes
  on cuda:k, so a factory call without `device=` makes a CPU tensor NCCL refuses. Under
  REFIMPL_DEVICE_AUDIT every rank records such calls made from refimpl's code
  (refimpl.lab.runtime.device_audit); apart from the few made on the host on purpose (HOST_BY_DESIGN), there
  must be none, in any strategy's set-up or step.
* **Everything else runs staged too.** `make test` sets REFIMPL_SHARED_DEVICE=cpu (the Makefile's
  STAGED) for the whole suite, so every launch of every test and notebook, notebook 10's faults,
  the overlap read from a trace (a staged collective shows as a `gloo:` range in flight) and the
  memory peaks included, runs under these rules; what this file adds is the comparison with plain
  gloo (`gloo_launch`, `on_gloo`, which unset it), the one-tag mode on plain gloo, the device
  audit (on 4 ranks in `full` only: `on_world`), and the launch paths no other test enters.
"""
import contextlib
import functools
import json
import os

import pytest

from refimpl import launch
from refimpl.lab.config import LabConfig
from refimpl.lab.verify.equivalence import (
    BF16_TOLERANCE,
    FP64_TOLERANCE,
    compare_states,
    compare_with_single,
    relative_error,
)
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig
from refimpl.train import merge_results, validate
from tests.models import SMALL

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)


def cfg(strategy, world, m=2, *, layers=4, experts=0, shape=None, **kw):
    model = GPTConfig(**{**SMALL.to_dict(), "n_layers": layers, "n_experts": experts, **(shape or {})})
    return LabConfig(strategy=strategy, nproc=world, steps=2, global_batch=8, micro_batches=m,
                     return_state=True, dtype="float64", model=model, **kw)


LLAMA_MQA = {"arch": "llama", "n_kv_heads": 1}   # RMSNorm, SwiGLU, rotary, grouped-query attention
RUNS = {
    2: {"pp-1f1b m4": cfg("pp-1f1b", 2, 4, pp=2),
        "pp-interleaved v2 m4": cfg("pp-interleaved", 2, 4, pp=2, virtual_stages=2),
        "pp-zb m4": cfg("pp-zb", 2, 4, pp=2),
        # the V: both chunks talk to the one neighbour in both directions, received in its order
        "pp-zbv m4": cfg("pp-zbv", 2, 4, pp=2), "pp-dualpipev m4": cfg("pp-dualpipev", 2, 4, pp=2),
        "pp-interleaved-zb v2 m2": cfg("pp-interleaved-zb", 2, 2, pp=2, virtual_stages=2),
        "ring attention cp2": cfg("dp-naive", 2, 1, cp=2),
        "zero2, rebuilt collectives": cfg("zero2", 2, collectives="refimpl"),
        # the buckets reduced during backward, the shard on the host (on one device here: the
        # host-vs-device check is test_zero2_offload_reduces_on_the_rank_s_device's)
        "zero2 offload": cfg("zero2", 2, options={"offload": True}),
        "dp": cfg("dp", 2), "zero3": cfg("zero3", 2), "fsdp": cfg("fsdp", 2),
        "tp + sp": cfg("tp", 2, tp=2, sequence_parallel=True),
        "ep, 4 experts": cfg("ep", 2, 1, experts=4),    # m = 1: capacity is per micro-batch
        # PyTorch's twins through the same backend: their collectives are staged too
        "torch-ddp": cfg("torch-ddp", 2), "torch-fsdp2": cfg("torch-fsdp2", 2),
        "torch-tp": cfg("torch-tp", 2, tp=2), "torch-pp-1f1b m4": cfg("torch-pp-1f1b", 2, 4, pp=2),
        # the variants the notebooks (03-06, 08) and the bench scripts (bench_dp, bench_fsdp,
        # bench_tp) train beyond the ones above, each once: what they send differs
        "zero1, 1 MB buckets": cfg("zero1", 2, options={"bucket_mb": 1.0}),
        "dp, 1 MB buckets": cfg("dp", 2, options={"bucket_mb": 1.0}),
        "torch-zero1": cfg("torch-zero1", 2), "torch-fsdp2-gradop": cfg("torch-fsdp2-gradop", 2),
        "fsdp grad_op": cfg("fsdp", 2, options={"sharding": "grad_op"}),
        "fsdp overlap_reduce": cfg("fsdp", 2, options={"overlap_reduce": True}),
        "fsdp offload": cfg("fsdp", 2, options={"offload": True}),
        "fsdp checkpointing": cfg("fsdp", 2, activation_checkpointing=True),
        "tp": cfg("tp", 2, tp=2), "torch-tp + sp": cfg("torch-tp", 2, tp=2, sequence_parallel=True),
        # SP's collectives decomposed over the ring: a send and a receive to the same peer each
        # step, posted as one batch (refimpl.comm.p2p.post), notebook 06 and bench_tp's variant
        "tp + sp, tp_overlap": cfg("tp", 2, tp=2, sequence_parallel=True, options={"tp_overlap": True}),
        "ep top-1, capacity 0.5": cfg("ep", 2, 1, experts=4, shape={"top_k": 1, "capacity_factor": 0.5}),
        "ep, bias balancing": cfg("ep", 2, 1, experts=4, shape={"balance": "bias", "bias_gamma": 0.01}),
        # --arch llama: one key/value head for 4 query heads, so both tp ranks hold it and sum its
        # gradient (refimpl.parallel.tp.layers), under SP; and ring attention's rotary positions
        "llama tp + sp, 1 K/V head shared": cfg("tp", 2, tp=2, sequence_parallel=True, shape=LLAMA_MQA),
        "llama ring attention cp2": cfg("dp-naive", 2, 1, cp=2, shape=LLAMA_MQA)},
    4: {"zero1 dp2 x pp2, rebuilt collectives": cfg("zero1", 4, 2, pp=2, collectives="refimpl"),
        "pp2 x cp2": cfg("dp-naive", 4, 2, pp=2, cp=2),
        "ring over tp heads tp2 x cp2 + sp": cfg("zero1", 4, 2, tp=2, cp=2, sequence_parallel=True),
        "pp-zbv 4 stages m4": cfg("pp-zbv", 4, 4, pp=4, layers=8),
        # scripts/bench_composition.py's pair (notebook 09 too)
        "fsdp dp2 x tp2 + sp": cfg("fsdp", 4, tp=2, sequence_parallel=True),
        "torch-fsdp2-tp dp2 x tp2 + sp": cfg("torch-fsdp2-tp", 4, tp=2, sequence_parallel=True)},
}
ON_A_GPU = (os.environ.get("REFIMPL_SHARED_DEVICE") or "cpu").startswith("cuda")  # scripts/gpu_check.sh
if ON_A_GPU:
    # CPUOffloadPolicy only where there is a device to offload from (torch_fsdp2.py): on the GPU
    # check's shared cuda:0, the host shards gathered on the device (full_tensor_on)
    RUNS[2]["torch-fsdp2 offload"] = cfg("torch-fsdp2", 2, options={"offload": True})
# Factory calls made on the host on purpose, each for a reason (refimpl path, function):
HOST_BY_DESIGN = {
    # the reference is built on the host from the seed (the same weights on every rank and
    # device), then placed on the rank's device by compose.transforms.model_parallel
    ("refimpl/model/", "__init__"),
    # ... and so is a block's norm, made by refimpl.model.parts for the block's __init__
    ("refimpl/model/parts.py", "norm"),
    # the batch is made by a CPU generator (the same tokens on any device), then moved to the
    # rank's device by Strategy.local_micro_batches
    ("refimpl/model/data.py", "synthetic_batch"),
    # the rank grid arange(world).view(dp, pp, cp, tp): arithmetic on rank numbers, never sent
    ("refimpl/mesh.py", "grid"),
    # the same grid for torch-fsdp2-tp's 2-D DeviceMesh, which keeps its mesh on the host
    ("refimpl/lab/twins/torch_fsdp2_tp.py", "dp_tp_device_mesh"),
}


# bf16, the profiler, memory recording and a wrong-number fault, in the same staged launch as
# RUNS[2] (a launch of its own costs seconds); the bf16 runs again on plain gloo (`gloo_launch`).
def bf16(strategy, world, m=2, *, layers=2, **kw):
    """autocast bf16 compute, fp32 master weights (TrainConfig.mixed_precision)."""
    return cfg(strategy, world, m, layers=layers, **kw).with_(dtype="float32", mixed_precision="bf16")


# name -> (the run, some of the "<op> <dtype>" its collectives hand the staged backend): what
# NCCL would be handed in bf16, so the dtype rule is exercised where it could bite
BF16 = {"fsdp bf16": (bf16("fsdp", 2), {"all_gather_into_tensor bfloat16",      # bf16 gather,
                                        "reduce_scatter_tensor float32"}),     # fp32 reduce
        # SP's activations cross in bf16 both ways; the sequence-parallel norms' sum too
        "tp + sp bf16": (bf16("tp", 2, tp=2, sequence_parallel=True),
                         {"all_gather_into_tensor bfloat16", "reduce_scatter_tensor bfloat16",
                          "all_reduce bfloat16"}),
        # the stage boundary is the residual stream, fp32 under autocast: sends and receives agree
        "pp-1f1b bf16": (bf16("pp-1f1b", 2, 4, pp=2), {"send float32", "recv float32"}),
        # ring attention's K/V blocks go round in bf16, one tag (REFIMPL_P2P_TAGS=one)
        "ring attention cp2 bf16": (bf16("dp-naive", 2, 1, cp=2), {"send bfloat16", "recv bfloat16"})}
PROFILED, RECORDING = "tp + sp bf16", "fsdp bf16"      # the one with --profile, with record_memory
# skip-grad-sync (refimpl.lab.faults, notebook 10): dp-naive leaves the last block out of its
# all-reduce; one step, so exactly that block's weights leave single's
FAULT = cfg("dp-naive", 2, 1, fault="skip-grad-sync").with_(steps=1)


def bf16_runs(trace_dir, staged: bool) -> dict:
    """BF16's runs, the profiled one writing to `trace_dir`; on the staged side memory recorded
    in one (record_memory and --profile exclude each other: refimpl.train)."""
    runs = {name: c for name, (c, _) in BF16.items()}
    runs[PROFILED] = runs[PROFILED].with_(profile=True, trace_dir=str(trace_dir))
    if staged:
        runs[RECORDING] = runs[RECORDING].with_(record_memory=True)
    return runs


def extras(world, audit_dir) -> dict:
    return {**bf16_runs(audit_dir / "trace", staged=True), "skip-grad-sync": FAULT} if world == 2 else {}


def _train_seeing_dtypes(rank: int, world: int, cfgs: list) -> list:
    """train_several_on_ranks' rank, noting for each run the "<op> <dtype>" of every tensor the
    staged backend checked (its `_check`, NCCL's argument rules); on plain gloo ranks none."""
    import gc

    import torch.distributed as dist

    from refimpl.train import train_rank

    seen = set()
    if dist.get_backend() == "staged":
        from refimpl.lab.runtime.shared_device import StagedGloo

        check = StagedGloo._check

        def seeing(self, tensors, op, opts=None):
            seen.update(f"{op} {str(t.dtype).removeprefix('torch.')}" for t in tensors)
            return check(self, tensors, op, opts)

        StagedGloo._check = seeing
    out = []
    for c in cfgs:
        seen.clear()
        out.append((train_rank(rank, world, c), sorted(seen)))
    gc.collect()        # as train_several_on_ranks' rank: the strategies' cycles, group alive
    return out


@contextlib.contextmanager
def environ(**changes):
    """os.environ with `changes` (None: unset) while open; the ranks launched inside inherit it."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        for k, v in changes.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def staged_rules(**more):
    return environ(REFIMPL_P2P_TAGS="one", REFIMPL_SHARED_DEVICE=(os.environ.get("REFIMPL_SHARED_DEVICE") or "cpu"),
                   **more)


def _collective_then_user_message(rank: int, world: int):
    """Rank 0 sends a collective's message (refimpl.comm's tag), then a pipeline's (tag 0); rank 1
    receives with tag 0 first. By posting order the first receive gets the collective's message."""
    import torch

    from refimpl.comm.p2p import GroupView, exchange
    from refimpl.seam import dist

    first, second = torch.zeros(3), torch.zeros(3)
    if rank == 0:
        exchange(GroupView.of(None), sends=[(torch.ones(3), 1)])
        dist.isend(torch.full((3,), 2.0), dst=1, tag=0).wait()
        return None
    dist.irecv(first, src=0, tag=0).wait()
    exchange(GroupView.of(None), recvs=[(second, 0)])
    return first.tolist(), second.tolist()


def test_one_tag_pairs_plain_gloo_messages_in_posting_order():
    """REFIMPL_P2P_TAGS=one on plain gloo (refimpl.lab.runtime.one_tag): a rebuilt collective's
    messages and a pipeline's pair as NCCL would pair them (by tag, this exchange hangs)."""
    with environ(REFIMPL_P2P_TAGS="one", REFIMPL_SHARED_DEVICE=None):
        got = launch.run(_collective_then_user_message, 2, backend="gloo", timeout=120, quiet=True)
    assert got[1] == ([1.0] * 3, [2.0] * 3)


def launch_seeing_dtypes(cfgs: dict, world: int, backend: str) -> dict:
    """`cfgs` in one launch (validated here first): each run's merged result, with `dtypes`."""
    for c in cfgs.values():
        validate(c)
    per_rank = launch.run(_train_seeing_dtypes, world, list(cfgs.values()), backend=backend,
                          timeout=300, quiet=True)
    runs = {}
    for i, (name, c) in enumerate(cfgs.items()):
        runs[name] = merge_results(c, [r[i][0] for r in per_rank])
        runs[name]["dtypes"] = set().union(*(r[i][1] for r in per_rank))
    return runs


@functools.lru_cache(maxsize=None)
def results(world, audit_dir):
    """RUNS[world] and `extras` in one staged launch: each run's merged result (with `dtypes`, what
    its collectives handed the staged backend, on any rank), and the device audit's finds."""
    cfgs = {**RUNS[world], **extras(world, audit_dir)}
    # FAULT's REFIMPL_FAULTS: checked by validate, in this process
    with staged_rules(REFIMPL_DEVICE_AUDIT=str(audit_dir), REFIMPL_FAULTS="1"):
        runs = launch_seeing_dtypes(cfgs, world, "staged")
    found = {}
    for rank in range(world):
        found.update(json.loads((audit_dir / f"rank{rank}.json").read_text()))
    return runs, found


@pytest.fixture(scope="module")
def audit_dirs(tmp_path_factory):
    return {w: tmp_path_factory.mktemp(f"audit{w}") for w in RUNS}


def on_world(world: int, *values):
    """A parameter of RUNS[world]: the 4-rank launch (13-16 s) is `full`'s. make test runs such
    layouts staged elsewhere, as it runs every launch (the layout matrix's 4-rank cover: pp2 x
    cp2, tp2 x cp2 + SP, fsdp and zero1 beside pp and tp; tests/test_pp.py: zbv on 4 stages;
    notebook 09: torch-fsdp2-tp with SP); what only this launch adds is the device audit on 4
    ranks."""
    return pytest.param(world, *values, marks=[pytest.mark.full] if world == 4 else [])


@pytest.mark.parametrize("world,name", [on_world(w, n) for w, runs in RUNS.items() for n in runs])
def test_posting_order_alone_pairs_every_message(world, name, audit_dirs):
    runs, _ = results(world, audit_dirs[world])
    eq = compare_with_single(RUNS[world][name], runs[name])
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, (eq.loss_rel_err, eq.weight_rel_err)


def by_design(site: str) -> bool:
    """`site` is "path:line function factory" (refimpl.lab.runtime.device_audit)."""
    where, function, _ = site.split(" ")
    return any(where.startswith(path) and function == fn for path, fn in HOST_BY_DESIGN)


@pytest.mark.parametrize("world", [on_world(w) for w in RUNS])
def test_every_tensor_a_rank_makes_names_its_device(world, audit_dirs):
    _, found = results(world, audit_dirs[world])
    assert found, "the audit saw nothing: it is not running"   # the reference build is always seen
    assert [site for site in sorted(found) if not by_design(site)] == []


@pytest.mark.parametrize("name", list(BF16))
def test_bf16_under_nccl_s_rules_is_gloo_s_run_bit_for_bit(name, audit_dirs, on_gloo):
    """bf16 under the staged backend: NCCL's dtype, op, contiguity and device rules hold for every
    tensor a bf16 step hands a collective (the bf16 ones included: `dtypes`), and the run is the
    same run on plain gloo. On CPU ranks the staged backend runs the same gloo calls on exact
    copies of the same tensors and only orders them, so losses and weights are equal to the bit; on the GPU check's shared cuda:0 the bf16 matmuls are the
    GPU's, and the gate is bf16's (BF16_TOLERANCE, refimpl.lab.verify.equivalence)."""
    staged, gloo = results(2, audit_dirs[2])[0][name], on_gloo[name]
    assert BF16[name][1] <= staged["dtypes"], sorted(staged["dtypes"])
    if name == "pp-1f1b bf16":
        assert not any(seen.endswith("bfloat16") for seen in staged["dtypes"]), staged["dtypes"]
    assert_same_run(staged, gloo)


def assert_same_run(staged: dict, gloo: dict) -> None:
    """Bit for bit on CPU ranks; within bf16's gate where the staged ranks are on the GPU check's
    cuda:0 (its matmuls are the GPU's, gloo's the CPU's)."""
    import torch

    if ON_A_GPU:
        weight_err = compare_states(staged["state_dict"], gloo["state_dict"])[0]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(staged["losses"], gloo["losses"]))
        assert max(weight_err, loss_err) <= BF16_TOLERANCE, (weight_err, loss_err)
        return
    assert staged["losses"] == gloo["losses"]
    assert staged["state_dict"].keys() == gloo["state_dict"].keys()
    differ = [k for k, v in gloo["state_dict"].items() if not torch.equal(staged["state_dict"][k], v)]
    assert differ == []


def in_bf16(c):
    return c.with_(dtype="float32", mixed_precision="bf16")


def takes_bf16(c) -> bool:
    """False for a layout that refuses bf16 before launch (tp_overlap runs in the model's dtype)."""
    try:
        validate(in_bf16(c))
    except LayoutError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def bf16_everywhere(world):
    """Every RUNS[world] layout that takes bf16, one launch staged, one on plain gloo."""
    cfgs = {name: in_bf16(c) for name, c in RUNS[world].items() if takes_bf16(c)}
    with staged_rules():
        staged = launch_seeing_dtypes(cfgs, world, "staged")
    with environ(REFIMPL_SHARED_DEVICE=None):
        gloo = launch_seeing_dtypes(cfgs, world, "gloo")
    return staged, gloo


@pytest.mark.full     # a launch per backend and world, every layout: a minute
@pytest.mark.parametrize("world,name", [(w, n) for w, runs in RUNS.items() for n, c in runs.items()
                                        if takes_bf16(c)])
def test_every_layout_in_bf16_under_nccl_s_rules_is_gloo_s_run(world, name):
    """As test_bf16_under_nccl_s_rules_is_gloo_s_run_bit_for_bit, for every layout of RUNS."""
    staged, gloo = bf16_everywhere(world)
    assert_same_run(staged[name], gloo[name])


def test_the_profiled_run_labels_its_communication_as_on_gloo(audit_dirs, on_gloo):
    """--profile (refimpl.lab.trace.capture.StepProfiler) under the staged backend: every profiled step
    of each rank has its phases and the same `comm:<op> <bytes>B` labels, one for one, as the
    same run profiled on plain gloo (the collectives run on the stream's worker thread there, the
    labels on the caller's), SP's all-gathers and reduce-scatters and tp's all-reduce among them.
    (gloo's own events, `c10d::...`, are on plain gloo's trace only: the staged backend's gloo
    calls run on its stream's thread, which the profiler does not record.)"""
    from refimpl.lab.trace.profiling import load_trace

    staged, gloo = results(2, audit_dirs[2])[0][PROFILED], on_gloo[PROFILED]
    assert staged["trace_dir"] != gloo["trace_dir"]

    def labels(trace_dir):
        df = load_trace(trace_dir)
        ours = df.name.str.startswith("comm:") | df.name.isin(["forward", "backward", "optimizer"])
        df = df[df.step.notna() & ours]     # not the backends' own events: gloo's, on its thread
        return {(rank, int(step)): sorted(g.name) for (rank, step), g in df.groupby(["rank", "step"])}

    got, want = labels(staged["trace_dir"]), labels(gloo["trace_dir"])
    assert got == want
    assert {rank for rank, _ in got} == {0, 1}
    for names in got.values():
        assert {"forward", "backward", "optimizer"} <= set(names), names
        ops = {n.split(" ")[0] for n in names if n.startswith("comm:")}
        assert {"comm:all_gather", "comm:reduce_scatter", "comm:all_reduce"} <= ops, names


def test_memory_is_recorded_under_nccl_s_rules(audit_dirs):
    """record_memory (refimpl.lab.trace.memory_events.StepPeak: the allocator's events on CPU,
    max_memory_allocated on CUDA) under the staged backend: a peak on every rank, above what the
    rank keeps (fsdp gathers each block's bf16 weights for a moment); the run itself is gloo's
    (test_bf16_under_nccl_s_rules_is_gloo_s_run_bit_for_bit)."""
    run = results(2, audit_dirs[2])[0][RECORDING]
    for rank in run["memory"]:
        assert rank["transient_peak"] is not None and rank["transient_peak"] > 0, rank


def test_a_wrong_number_fault_is_found_under_nccl_s_rules(audit_dirs):
    """Notebook 10's skip-grad-sync (refimpl.lab.faults) under the staged backend: the comparison with
    `single` still finds it and where it is. One step: the loss (computed before the update)
    is single's, and exactly the last block's tensors leave float64's gate, each by far."""
    from refimpl.lab.verify.equivalence import reference_run

    run, ref = results(2, audit_dirs[2])[0]["skip-grad-sync"], reference_run(FAULT)
    assert abs(run["losses"][0] - ref["losses"][0]) <= FP64_TOLERANCE * abs(ref["losses"][0])
    last = f"blocks.{FAULT.model.n_layers - 1}."
    errors = {k: relative_error(run["state_dict"][k], v) for k, v in ref["state_dict"].items()}
    off = sorted(k for k, e in errors.items() if e > FP64_TOLERANCE)
    assert off and all(k.startswith(last) for k in off), off
    assert min(errors[k] for k in off) > 1e-6, {k: errors[k] for k in off}


@pytest.mark.full     # a launch of its own, and single recorded beside it: seconds
def test_the_bisector_finds_the_fault_under_nccl_s_rules(monkeypatch):
    """refimpl.lab.verify.bisect on the staged backend (every rank's recording hook, its gathers of
    the weights each step): it names skip-grad-sync where it names it on gloo
    (tests/test_when_it_goes_wrong.py): step 0's optimizer, the last block."""
    from refimpl.lab import faults
    from refimpl.lab.verify import bisect as bisector

    for name, value in ((faults.ENV, "1"), ("REFIMPL_P2P_TAGS", "one"),
                        ("REFIMPL_SHARED_DEVICE", (os.environ.get("REFIMPL_SHARED_DEVICE") or "cpu"))):
        monkeypatch.setenv(name, value)
    report = bisector.bisect(LabConfig(strategy="dp-naive", nproc=2, steps=2, model=SMALL,
                                       dtype="float64", fault="skip-grad-sync"))
    assert report.verdict == "bug"
    last = f"blocks.{SMALL.n_layers - 1}"
    assert (report.first.step, report.first.phase, report.first.module) == (0, "optimizer", last)


def test_the_audit_names_a_factory_call_without_a_device():
    """On a made-up site list, the filter keeps exactly the call that breaks the rule."""
    sites = ["refimpl/model/layers.py:19 __init__ empty", "refimpl/parallel/cp/ring.py:73 positions arange",
             "refimpl/model/data.py:51 synthetic_batch randperm"]
    assert [s for s in sites if not by_design(s)] == ["refimpl/parallel/cp/ring.py:73 positions arange"]


def _on_gloo_ranks(rank: int, world: int, bf16_cfgs: list) -> dict:
    """The checks that need no staged world, in one (forked, fast) gloo launch: BF16's runs on
    plain gloo (before anything here touches the staged backend), notebook 07's pipeline helper,
    then both posting plans on a staged group (`_both_plans_on_the_strict_stream`)."""
    import gc

    from refimpl.lab.measure.pp_measure import profile_pipeline
    from refimpl.train import train_rank

    on_gloo = [train_rank(rank, world, c) for c in bf16_cfgs]
    gc.collect()
    profile_pipeline(rank, world, SMALL, "1f1b", 4, steps=1, global_batch=8)
    return {**_both_plans_on_the_strict_stream(rank, world), "bf16": on_gloo}


@pytest.fixture(scope="module")
def gloo_launch(tmp_path_factory):
    """Each rank's `_on_gloo_ranks` result, and the factory calls the device audit found."""
    from refimpl.launch import run

    audit_dir = tmp_path_factory.mktemp("audit_gloo")
    cfgs = bf16_runs(audit_dir / "trace", staged=False)
    with environ(REFIMPL_DEVICE_AUDIT=str(audit_dir)):
        results = run(_on_gloo_ranks, 2, list(cfgs.values()), backend="gloo", quiet=True, timeout=180)
    found = {}
    for rank in range(2):
        found.update(json.loads((audit_dir / f"rank{rank}.json").read_text()))
    return results, found


@pytest.fixture(scope="module")
def on_gloo(gloo_launch):
    """BF16's runs on plain gloo, merged as train_several_on_ranks merges them."""
    per_rank, _ = gloo_launch
    return {name: merge_results(c, [r["bf16"][i] for r in per_rank])
            for i, (name, (c, _)) in enumerate(BF16.items())}


def test_notebook_07s_pipeline_helper_names_its_device(gloo_launch):
    """07 §5-6 profile the pipeline through pp.measure.profile_pipeline, outside the train loop
    (the same launch audits BF16's runs on gloo too: their staged twins are audited in RUNS[2]'s)."""
    _, found = gloo_launch
    assert found, "the audit saw nothing: it is not running"
    assert [site for site in sorted(found) if not by_design(site)] == []


def test_the_staged_backend_refuses_a_tensor_off_the_rank_s_device():
    from datetime import timedelta

    import torch

    from refimpl.lab.runtime.shared_device import StagedGloo

    on_meta = StagedGloo(torch.distributed.HashStore(), 0, 1, timedelta(seconds=30), torch.device("meta"))
    with pytest.raises(RuntimeError, match="NCCL would refuse it"):
        on_meta.allreduce([torch.ones(3)])              # a CPU tensor; the rank's device is meta
    on_cpu = StagedGloo(torch.distributed.HashStore(), 0, 1, timedelta(seconds=30), torch.device("cpu"))
    x = torch.ones(3)
    on_cpu.allreduce([x]).wait()
    assert x.tolist() == [1.0, 1.0, 1.0]                # one rank: the sum is itself


def test_a_failed_staged_collective_raises_where_it_is_waited_on():
    """A collective the stream could not run (a peer gone, its timeout: here a planted failure)
    raises in `wait` and through the future DDP's hooks chain on. torch's future-backed Work
    returned normally from `wait` on a failed future: a rank whose peer died went on (and notebook
    10's killed rank was found only once its peers' sleep ended)."""
    from datetime import timedelta

    import torch

    from refimpl.lab.runtime.shared_device import StagedGloo

    group = StagedGloo(torch.distributed.HashStore(), 0, 1, timedelta(seconds=30), torch.device("cpu"))
    group.stream.failed = "planted: the peer is gone"
    with pytest.raises(RuntimeError, match="planted: the peer is gone"):
        group.allreduce([torch.ones(3)]).wait()
    with pytest.raises(RuntimeError, match="planted: the peer is gone"):
        group.allreduce([torch.ones(3)]).get_future().wait()


def _both_plans_on_the_strict_stream(rank: int, world: int) -> dict:
    """One rank of 1F1B on 2 stages (m = 4) on a staged group, under its stream order: the core's
    own links (links.Links: the global order, order.rank_order), then the
    old one-ahead posting (lab.pipeline.posting.AheadLinks: receives of this entry and the next posted before
    the entry, each send as its action ends). The launch is a gloo one (`_on_gloo_ranks`); the
    group is the staged backend's."""
    import time

    import torch
    import torch.distributed as dist

    from refimpl.lab.pipeline.posting import AheadLinks
    from refimpl.model import build_model, lm_loss, synthetic_batch
    from refimpl.parallel.pp.links import Links
    from refimpl.parallel.pp.runner import Backward, run_schedule, schedule_table
    from refimpl.parallel.pp.stage import build_chunks

    out, group = {}, dist.new_group([0, 1], backend="staged")
    device = group.device       # REFIMPL_SHARED_DEVICE's (scripts/gpu_check.sh: cuda:0), else the CPU
    # the rendezvous the stream relies on: a send stays incomplete while no receive is posted
    # (rank 1 posts its receive only after rank 0 has looked, told by the world group: gloo's own)
    x = torch.full((8,), 1.0 + rank, device=device)
    if rank == 0:
        w = dist.isend(x, group=group, group_dst=1)
        time.sleep(0.2)
        out["send_done_before_its_recv"] = w.is_completed()
        dist.barrier()
        w.wait()
    else:
        dist.barrier()
        got = torch.zeros(8, device=device)
        dist.recv(got, group=group, group_src=0)
        out["received"] = got.tolist()
    cfg = GPTConfig(**{**SMALL.to_dict(), "n_layers": 2})
    chunks = build_chunks(build_model(cfg, 0).double().to(device), 2, rank)
    batch = synthetic_batch(cfg, 8, cfg.seq_len, 0, 0).to(device)
    micro, table = batch.micro_batches(4), schedule_table(2, 4, "1f1b")
    loss = run_schedule(chunks, table, micro, group, links=Links, backward=Backward)
    if rank == 1:
        reference = build_model(cfg, 0).double().to(device)
        out["loss"], out["single"] = loss.item(), lm_loss(reference(batch.inputs), batch.targets).item()
    dist.barrier(group)
    group.stream.timeout = 2.0      # from here no wait is legitimately longer (a tiny model's F/B)
    start = time.monotonic()
    try:
        run_schedule(chunks, table, micro, group, links=AheadLinks)
        out["old plan"] = "finished"
    except RuntimeError as e:
        out["old plan"] = str(e)
    print(f"rank {rank}: the old plan failed after {time.monotonic() - start:.1f} s")
    return out


def test_the_strict_stream_hangs_the_old_posting_and_runs_the_global_order(gloo_launch):
    """refimpl.lab.runtime.staged_stream under the staged backend: each group's operations run in posting
    order, one at a time, a send only once its receive has started. The runner's order finishes
    and its loss equals single's; the old one-ahead posting deadlocks exactly as nccl_order's
    docstring says (stage 0 waits in B0's receive with F1's send behind it, stage 1 in F1's
    receive with B0's gradient behind it), and the stream's timeout names it on both ranks."""
    (first, last), _ = gloo_launch
    assert first["send_done_before_its_recv"] is False and last["received"] == [1.0] * 8
    assert abs(last["loss"] - last["single"]) <= 1e-12 * abs(last["single"]), (last["loss"], last["single"])
    # tags: 1 + (kind * pieces + piece) * m + mb, pieces = 2, m = 4 (links.Links.tag)
    f1, b0 = 1 + (0 * 2 + 1) * 4 + 1, 1 + (1 * 2 + 0) * 4 + 0
    for rank, got, blocked, behind in ((0, first, f"recv from group rank 1 (tag {b0}", f"send to group rank 1 (tag {f1}"),
                                       (1, last, f"recv from group rank 0 (tag {f1}", f"send to group rank 0 (tag {b0}")):
        message = got["old plan"]
        assert f"rank {rank} (group rank {rank}) blocked in {blocked}" in message, message
        assert message.split("waiting behind it: ")[1].startswith(f"['{behind}"), message


def test_the_staged_backend_refuses_what_nccl_refuses():
    """NCCL's argument rules beyond the device (refimpl.lab.runtime.shared_device): contiguous tensors, a dtype
    NCCL has, a reduce op NCCL has. gloo accepts each of these calls."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from refimpl.lab.runtime.shared_device import StagedGloo

    group = StagedGloo(torch.distributed.HashStore(), 0, 1, timedelta(seconds=30), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="non-contiguous.*Tensors must be contiguous"):
        group.allreduce([torch.ones(3, 2).t()])
    with pytest.raises(RuntimeError, match="non-contiguous"):
        group.send([torch.ones(3, 2).t()], 0)
    with pytest.raises(RuntimeError, match="dtype torch.int16"):
        group.broadcast([torch.ones(3, dtype=torch.int16)])
    band = dist.AllreduceOptions()
    band.reduceOp = dist.ReduceOp.BAND
    with pytest.raises(RuntimeError, match="ReduceOp.BAND"):
        group.allreduce([torch.ones(3, dtype=torch.int64)], band)
    x = torch.ones(3, 2).t().contiguous()
    group.allreduce([x]).wait()                         # the same values, contiguous: accepted
    assert x.tolist() == [[1.0] * 3] * 2


def test_zero2_offload_reduces_on_the_rank_s_device():
    """ZeRO-2 with offload (issue 35): the gradient shard is the host master's gradient, and each
    bucket must still be reduced on the rank's device, then moved to the host. A CPU-only machine
    has one device for both, so the host stands on `meta` here (the values are not the point,
    where each tensor lives is): a bucket made on the shard's device reaches the staged backend
    on meta and is refused, as NCCL refuses a host tensor."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from refimpl.lab.runtime.shared_device import StagedGloo
    from refimpl.parallel.dp.flat_param import FlatParams
    from refimpl.parallel.zero.streaming_reduce import StreamingReduce

    group = StagedGloo(torch.distributed.HashStore(), 0, 1, timedelta(seconds=30), torch.device("cpu"))
    params = [torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(7))]
    layout = FlatParams(list(zip("ab", params)), world_size=1)
    host_grad_shard = torch.zeros(layout.shard_numel, device="meta")    # offload's master.grad
    reduced = []

    def reduce_to_owner(bucket, buf):
        reduced.append(buf.device)
        return group.reduce([buf], dist.ReduceOptions())

    stream = StreamingReduce(layout, 5 * 4, [], reduce_to_owner, host_grad_shard, 0)  # 2 buckets
    stream.arm(sync=True)
    (2 * params[0].sum() + 3 * params[1].sum()).backward()
    stream.wait()
    assert reduced == [torch.device("cpu")] * 2, reduced
    assert all(p.grad is None for p in params)           # freed once its bucket left


def _notebook_and_bench_paths(rank: int, world: int) -> dict:
    """The launch paths outside the training loop, on a staged world (NCCL's stream order and
    argument rules), each small: notebook 07's and scripts/bench_bubble.py's pipeline profile
    (measure.run_each of profile_pipeline), scripts/bench_pp.py's rank, notebook 01's comparison
    with torch.distributed, its primitives and overlap demo, notebook 06's tp checks, notebook
    09's ring-attention measure, scripts/bench_collectives.py's sweep (cost.bench) and
    torch-fsdp2's gather of offloaded shards (`_fsdp2_offload_gather`). Each
    path's error, if any, is kept and the next one runs (a failed pipeline only fails its own
    group's stream)."""
    from refimpl.lab.measure import pp_measure as measure
    from refimpl.lab.measure.async_demo import overlap_demo
    from refimpl.lab.measure.bench import sweep_rank
    from refimpl.lab.measure.cp_measure import ring_rank
    from refimpl.lab.measure.primitives import run_primitives
    from refimpl.lab.measure.versus_torch import check_and_count
    from refimpl.lab.verify.tp_checks import all_checks
    from scripts import bench_pp

    out = {}

    def attempt(name, fn, *args):
        try:
            out[name] = fn(*args)
        except RuntimeError as e:
            out[name] = f"error: {e}"

    calls = [((SMALL, s, 4), {"steps": 1, "global_batch": 8}) for s in ("1f1b", "gpipe")]
    attempt("profile_pipeline", measure.run_each, rank, world, measure.profile_pipeline, calls)
    args = bench_pp.parse(["--schedules", "1f1b", "--rounds", "1", "--steps", "2", "--layers", "2",
                           "--d-model", "32", "--global-batch", "8", "--seq-len", "16"])
    attempt("bench_pp", bench_pp.bench_rank, rank, world, args, ["1f1b"])
    attempt("versus_torch", check_and_count, rank, world)
    for impl in ("torch", "refimpl"):
        attempt(f"primitives {impl}", lambda: run_primitives(rank, world, impl=impl))
    attempt("overlap_demo", overlap_demo, rank, world, 1 << 12)
    attempt("tp checks", lambda: all_checks(rank, world, models=()))   # layers; the models cost seconds
    attempt("ring attention", ring_rank, rank, world)
    attempt("collectives sweep", lambda: sweep_rank(rank, world, sizes=[4, 4096], warmup=1, repeats=1))
    attempt("torch-fsdp2 offload gather", _fsdp2_offload_gather, rank, world)
    return out


def _fsdp2_offload_gather(rank: int, world: int) -> dict:
    """torch-fsdp2's state dict under CPUOffloadPolicy: each parameter a DTensor whose local shard
    lives in host memory while its mesh is the device's, built as FSDP2 builds it
    (_from_local_no_grad). `full_tensor()` hands the host shard to the all-gather; `full_tensor_on`
    (the strategy's full_state_dict) gathers on the device. On a GPU the device is the staged
    world's (cuda:0) and the gathered values are returned; on a CPU-only machine host and device
    are one memory, so the device stands on `meta` (a staged group of its own), as in
    test_zero2_offload_reduces_on_the_rank_s_device: where each tensor lives is the point."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from refimpl.lab.runtime import shared_device
    from refimpl.lab.twins.torch_fsdp2 import full_tensor_on

    group = dist.group.WORLD
    if group.device.type == "cpu":
        saved = os.environ.get(shared_device.ENV)
        os.environ[shared_device.ENV] = "meta"        # read by the staged backend's group factory
        try:
            group = dist.new_group(list(range(world)), backend="staged")
        finally:
            if saved is None:
                del os.environ[shared_device.ENV]
            else:
                os.environ[shared_device.ENV] = saved
    device = group.device
    host_shard = torch.arange(6, dtype=torch.float64).view(3, 2) + 100 * rank
    spec = DTensorSpec(DeviceMesh.from_group(group, device.type), (Shard(0),),
                       tensor_meta=TensorMeta(torch.Size([3 * world, 2]), (2, 1), torch.float64))
    offloaded = _from_local_no_grad(host_shard, spec)
    out = {}
    try:
        offloaded.full_tensor()
        out["full_tensor"] = "gathered the host shards"
    except RuntimeError as e:
        out["full_tensor"] = str(e)
    whole = full_tensor_on(offloaded, device)
    out["device"], out["shape"] = str(whole.device), tuple(whole.shape)
    out["values"] = None if device.type == "meta" else whole.cpu().tolist()
    return out


@pytest.fixture(scope="module")
def staged_launch():
    from refimpl.launch import run

    saved = os.environ.get("REFIMPL_STAGED_TIMEOUT")
    os.environ["REFIMPL_STAGED_TIMEOUT"] = "30"     # a tiny model's waits are far shorter
    try:
        return run(_notebook_and_bench_paths, 2, backend="staged", quiet=True, timeout=240)
    finally:
        if saved is None:
            os.environ.pop("REFIMPL_STAGED_TIMEOUT")
        else:
            os.environ["REFIMPL_STAGED_TIMEOUT"] = saved


def test_notebook_07s_pipeline_helper_runs_in_nccl_s_stream_order(staged_launch):
    """pp.measure.profile_pipeline (notebook 07, scripts/bench_bubble.py) on the staged backend:
    before issue 35 it posted receives one entry ahead and hung there, as it would on NCCL."""
    import torch

    from refimpl.model import build_model, lm_loss, synthetic_batch

    got = [r["profile_pipeline"] for r in staged_launch]
    assert not any(isinstance(g, str) for g in got), got
    batch = synthetic_batch(SMALL, 8, SMALL.seq_len, 0, 0)
    with torch.no_grad():
        single = lm_loss(build_model(SMALL, 0)(batch.inputs), batch.targets).item()
    for schedule, last in zip(("1f1b", "gpipe"), got[1]):
        assert abs(float(last["loss"]) - single) <= 1e-5 * abs(single), (schedule, last["loss"], single)


def test_bench_pp_runs_in_nccl_s_stream_order(staged_launch):
    got = [r["bench_pp"] for r in staged_launch]
    assert not any(isinstance(g, str) for g in got), got
    losses = {side: got[1][("1f1b", side)][1] for side in ("ours", "torch")}
    assert abs(losses["ours"] - losses["torch"]) <= 1e-5 * abs(losses["torch"]), losses


def test_notebook_01s_comparison_keeps_nccl_s_argument_rules(staged_launch):
    """versus_torch (notebook 01) on the staged backend: before issue 35 it handed torch's
    all-reduce a transposed tensor, which ProcessGroupNCCL refuses."""
    got = [r["versus_torch"] for r in staged_launch]
    assert not any(isinstance(g, str) for g in got), got
    rows = [row for r in got for row in r[0]]
    assert rows and all(row["equal"] for row in rows), [row for row in rows if not row["equal"]]


def test_every_other_notebook_and_bench_helper_runs_under_nccl_s_rules(staged_launch):
    """The helpers without a check of their own above: each ran to the end on the staged world."""
    others = ["primitives torch", "primitives refimpl", "overlap_demo", "tp checks", "ring attention",
              "collectives sweep"]
    failed = {name: r[name] for r in staged_launch for name in others if isinstance(r[name], str)}
    assert failed == {}, failed


def test_torch_fsdp2_offload_gathers_its_host_shards_on_the_device(staged_launch):
    """torch-fsdp2 with offload (issue 35): FSDP2 keeps the shards in host memory, and the state
    dict's gather handed them to the all-gather as they were, which NCCL refuses and so does the
    staged backend; full_tensor_on moves each shard to the rank's device first. (The whole
    strategy with offload runs in RUNS on the GPU check's shared cuda:0; on CPU ranks FSDP2 has
    nowhere to offload from.)"""
    got = [r["torch-fsdp2 offload gather"] for r in staged_launch]
    assert not any(isinstance(g, str) for g in got), got
    world = len(got)
    for g in got:
        assert "all_gather" in g["full_tensor"] and "a tensor on cpu" in g["full_tensor"], g
        assert g["device"] != "cpu" and g["shape"] == (3 * world, 2), g
        if g["values"] is not None:   # a GPU: rank r's rows are 100 r + 0..5
            assert g["values"] == [[100 * r + 2 * i + j for j in range(2)] for r in range(world)
                                   for i in range(3)], g
