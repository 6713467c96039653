"""ZeRO-3 and FSDP (ours) and FSDP2 (PyTorch's): same maths as `single`, the memory ZeRO predicts,
and the overlap prefetching buys.

Each launch costs seconds of process start-up, so there is one launch per world size, running
every configuration the tests need one after another in the same ranks (`runs_on`, cached); each
run serves several tests: the 2-rank zero3/fsdp runs are also profiled (and repeated with the
allocator's events recorded), the 3-rank zero3 run also offloads, one 4-rank run also checkpoints
activations.
"""
from functools import cache

import pytest

from refimpl.config import TrainConfig
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_recording_memory
from refimpl.lab.measure.volume import total_volume
from refimpl.lab.trace.profiling import comm_table, load_trace, summarize
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single
from refimpl.memory import model_state_bytes, sharded_state_bytes
from refimpl.mesh import LayoutError
from refimpl.model import build_model, count_params
from refimpl.parallel.fsdp.zero3 import gpt_units
from refimpl.train import validate
from tests.models import SMALL

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

STEPS = 3
# The "fp32" runs below are float64 (the equivalence gate of refimpl.lab.verify.equivalence holds on
# any processor there); bf16 runs keep fp32 master weights. Bytes per master element:
ELEMENT = 8


def config(strategy: str, nproc: int, *, trace_dir=None, **kw) -> TrainConfig:
    options = kw.pop("options", {})
    kw["dtype"] = "float64" if kw.get("mixed_precision", "fp32") == "fp32" else "float32"
    return LabConfig(strategy=strategy, nproc=nproc, steps=STEPS, model=SMALL,
                     global_batch=12 if nproc == 3 else 8, profile=trace_dir is not None,
                     trace_dir=trace_dir, return_state=True, options=dict(options), **kw)


def run(strategy: str, nproc: int, options: tuple = (), checkpointing: bool = False,
        mixed_precision: str = "fp32", micro_batches: int = 1) -> dict:
    return runs_on(nproc)[(strategy, tuple(options), checkpointing, mixed_precision,
                           micro_batches)]


# Every configuration a test below asks for, by world size: one launch per world size runs them all
# in the same ranks, one after another (train_several_on_ranks), paying start-up three times.
GRAD_OP, OFFLOAD = (("sharding", "grad_op"),), (("offload", True),)
WANTED = {   # (strategy, options, activation checkpointing, precision, micro-batches)
    2: [("zero3", (), False, "fp32", 1), ("fsdp", (), False, "fp32", 1),
        ("fsdp", GRAD_OP, False, "fp32", 1), ("torch-fsdp2", (), False, "fp32", 1),
        ("dp", (), False, "fp32", 1), ("zero1", (), False, "fp32", 1),
        ("zero2", (), False, "fp32", 1), ("zero3", (), False, "fp32", 2),
        ("fsdp", (), False, "bf16", 1), ("torch-fsdp2", (), False, "bf16", 1),
        ("fsdp", OFFLOAD + (("overlap_reduce", True),), True, "bf16", 1)],
    3: [("zero3", OFFLOAD, False, "fp32", 1), ("fsdp", (), False, "fp32", 1),
        ("fsdp", GRAD_OP, False, "fp32", 1), ("torch-fsdp2", (), False, "fp32", 1)],
    4: [("zero3", (), False, "fp32", 1), ("fsdp", (), True, "fp32", 1),
        ("fsdp", GRAD_OP, False, "fp32", 1), ("torch-fsdp2", (), False, "fp32", 1)],
}
PROFILED = {"zero3", "fsdp"}     # fp32, 2 ranks: their traces feed the communication tests


MEMORY = [("zero3", ()), ("fsdp", ()), ("fsdp", GRAD_OP)]   # 2 ranks, allocator events recorded


@cache
def runs_on(nproc: int) -> dict:
    import tempfile

    cfgs = []
    for strategy, options, checkpointing, mp, micro in WANTED[nproc]:
        profiled = nproc == 2 and strategy in PROFILED and mp == "fp32" and micro == 1
        trace_dir = tempfile.mkdtemp(prefix=f"{strategy}-") if profiled else None
        cfgs.append(config(strategy, nproc, trace_dir=trace_dir, options=dict(options),
                           activation_checkpointing=checkpointing, mixed_precision=mp,
                           micro_batches=micro))
    keys = list(WANTED[nproc])
    if nproc == 2:   # the same runs again, unprofiled, with the allocator's events recorded
        cfgs += [config(s, nproc, options=dict(o)) for s, o in MEMORY]
        keys += [("memory", s, o) for s, o in MEMORY]
    results = train_several_recording_memory(cfgs, [k[0] == "memory" for k in keys])
    for cfg, result in zip(cfgs, results):
        result["cfg"] = cfg
    return dict(zip(keys, results))


# (strategy, world size, options, activation checkpointing)
CASES = [
    ("zero3", 2, (), False),
    ("zero3", 3, (("offload", True),), False),
    ("zero3", 4, (), False),
    ("fsdp", 2, (), False),
    ("fsdp", 3, (), False),
    ("fsdp", 4, (), True),
    ("fsdp", 2, (("sharding", "grad_op"),), False),
    ("fsdp", 3, (("sharding", "grad_op"),), False),
    ("fsdp", 4, (("sharding", "grad_op"),), False),
    ("torch-fsdp2", 2, (), False),
    ("torch-fsdp2", 3, (), False),
    ("torch-fsdp2", 4, (), False),
]


@pytest.mark.parametrize("strategy,nproc,options,checkpointing", CASES,
                         ids=[f"{s}-n{n}{''.join(f'-{v}' for _, v in o)}{'-ckpt' if c else ''}"
                              for s, n, o, c in CASES])
def test_equivalent_to_single(strategy, nproc, options, checkpointing):
    result = run(strategy, nproc, options, checkpointing)
    eq = compare_with_single(result["cfg"], result)
    assert eq.tolerance == FP64_TOLERANCE
    assert eq.loss_rel_err <= FP64_TOLERANCE, (eq.losses, eq.reference_losses)
    assert eq.weight_rel_err <= FP64_TOLERANCE, eq.weight_rel_err


def test_gradient_accumulation_over_micro_batches():
    # Each micro-batch's backward reduce-scatters and adds into the gradient shard.
    result = run("zero3", 2, micro_batches=2)
    eq = compare_with_single(result["cfg"], result)
    assert eq.loss_rel_err <= FP64_TOLERANCE and eq.weight_rel_err <= FP64_TOLERANCE


def test_options_combine():
    # bf16 + offload + overlapped reduce-scatter + activation checkpointing: recomputation
    # repeats the same bf16 arithmetic and offload moves the same bits, so the losses are
    # bf16's own, to the bit.
    combined = run("fsdp", 2, OFFLOAD + (("overlap_reduce", True),), True, "bf16")
    assert combined["losses"] == run("fsdp", 2, (), False, "bf16")["losses"]
    assert all(m["params"] == m["grads"] == m["optimizer"] == 0 for m in combined["memory"])


def unit_sizes() -> list[int]:
    model = build_model(SMALL, 0)
    return [sum(p.numel() for _, m in mods for p in m.parameters()) for _, mods in gpt_units(model)]


@pytest.mark.parametrize("strategy,nproc,options", [
    ("zero3", 2, ()), ("fsdp", 3, ()), ("fsdp", 2, (("sharding", "grad_op"),))])
def test_model_state_matches_zero3_arithmetic_to_the_byte(strategy, nproc, options):
    # Each unit pads to a multiple of the world size on its own: sum over units, not ceil(N/dp).
    predicted = sharded_state_bytes(unit_sizes(), dp=nproc, zero_stage=3, param_bytes=ELEMENT,
                                    grad_bytes=ELEMENT, optimizer_bytes=2 * ELEMENT)
    for mem in run(strategy, nproc, options)["memory"]:
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (
            predicted.params, predicted.grads, predicted.optimizer)
    n_params = count_params(build_model(SMALL, 0))
    assert sum(unit_sizes()) == n_params
    if nproc == 3:   # per-unit padding never costs less than one flat buffer's
        assert predicted.params >= model_state_bytes(n_params, dp=3, zero_stage=3,
                                                    param_bytes=ELEMENT).params


def test_offload_leaves_no_model_state_on_the_device():
    for mem in run("zero3", 3, (("offload", True),))["memory"]:
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (0, 0, 0)


def test_model_state_falls_stage_by_stage():
    per_rank = {s: run(s, 2)["memory"][0] for s in ("dp", "zero1", "zero2", "zero3")}
    totals = [per_rank[s]["params"] + per_rank[s]["grads"] + per_rank[s]["optimizer"]
              for s in ("dp", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals


def test_gathered_parameters_are_not_counted_as_activations():
    # Same rows per rank -> the same activations, whoever gathers the weights and however.
    peaks = {s: run(s, 2)["memory"][0]["activations_peak"] for s in ("zero3", "fsdp", "torch-fsdp2")}
    assert len(set(peaks.values())) == 1, peaks


def test_activation_checkpointing_saves_activations():
    plain = run("zero3", 4)["memory"][0]["activations_peak"]
    checkpointed = run("fsdp", 4, (), True)["memory"][0]["activations_peak"]
    assert checkpointed < plain / 4, (checkpointed, plain)


def test_bf16_matches_fsdp2_and_is_close_to_fp32():
    ours = run("fsdp", 2, (), False, "bf16")["losses"]
    twin = run("torch-fsdp2", 2, (), False, "bf16")["losses"]
    exact = run("fsdp", 2)["losses"]                       # the float64 run
    assert ours == pytest.approx(twin, rel=1e-6)           # same policy: bf16 gather, fp32 reduce
    assert ours != exact and ours == pytest.approx(exact, rel=1e-3)


def comm_per_step(strategy: str, options=()):
    result = run(strategy, 2, options)
    table = comm_table(load_trace(result["trace_dir"]))
    steps = STEPS - 1                                     # the profiler's first step is warm-up
    return {(r.rank, r.op): (r.count / steps, r.bytes / steps) for r in table.itertuples()}


def test_comm_is_labelled_and_volume_is_three_psi():
    padded = sum(-(-n // 2) * 2 for n in unit_sizes()) * ELEMENT    # bytes, padded per unit
    units = len(unit_sizes())
    for rank in (0, 1):
        comm = comm_per_step("zero3")
        # ZeRO §7.2.2: all-gather before forward and again before backward, then reduce-scatter.
        assert comm[rank, "all_gather"] == (2 * units, 2 * padded)
        assert comm[rank, "reduce_scatter"] == (units, padded)
        fsdp = comm_per_step("fsdp")
        head = -(-unit_sizes()[-1] // 2) * 2 * ELEMENT  # kept gathered from forward to backward
        assert fsdp[rank, "all_gather"] == (2 * units - 1, 2 * padded - head)
        grad_op = comm_per_step("fsdp", (("sharding", "grad_op"),))
        assert grad_op[rank, "all_gather"] == (units, padded)      # 2Ψ in all, like ZeRO-2


def test_volume_in_paper_units_and_transient_memory_from_the_trace():
    psi = ELEMENT * sum(unit_sizes())
    assert total_volume(run("zero3", 2)["trace_dir"]) == {0: 3 * psi, 1: 3 * psi}   # ZeRO §7.2.2
    # The allocator's events: FULL_SHARD holds one unit (zero3) or two (fsdp prefetching) at a
    # time; SHARD_GRAD_OP holds every unit from its forward to its backward.
    peak = {(s, o): max(runs_on(2)["memory", s, o]["transient_peak"].values()) for s, o in MEMORY}
    assert peak["zero3", ()] < peak["fsdp", ()] < peak["fsdp", GRAD_OP], peak


def forward_calls(strategy: str) -> dict:
    """Per rank and profiled step: the forward phase's labelled calls in the order they were made,
    ("all_gather", bytes) or ("wait", None) -- a prefetch's wait on its all-gather."""
    df = load_trace(run(strategy, 2)["trace_dir"])
    df = df[df.step.notna()]
    calls = {}
    for (rank, step), g in df.groupby(["rank", "step"]):
        comm = g[(g.category == "comm") & g.name.str.startswith("comm:")]
        for f in g[g.category == "forward"].itertuples():
            inside = comm[(comm.start_us >= f.start_us) & (comm.start_us < f.start_us + f.dur_us)]
            calls.setdefault((rank, step), []).extend(
                (op, None if op == "wait" else int(b)) for op, b in zip(inside.op, inside.bytes))
    assert len(calls) == 2 * (STEPS - 1), calls.keys()
    return calls


def test_forward_prefetch_gathers_the_next_unit_while_this_one_computes():
    # fsdp: unit i's pre-hook waits for its own all-gather, then posts unit i+1's (FSDP §3.3), so
    # every all-gather after the first is posted before the wait of the unit before it; zero3
    # gathers each unit when it is reached. Both gather every unit once, in forward order.
    gathered = [("all_gather", -(-n // 2) * 2 * ELEMENT) for n in unit_sizes()]
    for calls in forward_calls("zero3").values():
        assert calls == gathered, calls
    for calls in forward_calls("fsdp").values():
        waited = [gathered[0]] + [c for pair in zip(gathered[1:], [("wait", None)] * len(gathered))
                                  for c in pair]
        assert calls == waited, calls


def test_prefetch_hides_communication():
    hidden = {s: summarize(load_trace(run(s, 2)["trace_dir"])).comm_hidden_frac.min()
              for s in ("zero3", "fsdp")}
    assert hidden["zero3"] < 0.02 and hidden["fsdp"] > hidden["zero3"], hidden


@pytest.mark.parametrize("strategy,options,message", [
    ("fsdp", {"sharding": "hybrid"}, "sharding"), ("zero3", {"sharding": "full"}, "no option"),
    ("torch-fsdp2", {"prefetch": 2}, "no option")])
def test_bad_options_fail_before_launch(strategy, options, message):
    with pytest.raises(LayoutError, match=message):
        validate(LabConfig(strategy=strategy, nproc=2, options=options))
    with pytest.raises(LayoutError, match="multiple of 3 data-parallel"):
        validate(LabConfig(strategy=strategy, nproc=3, global_batch=8))
