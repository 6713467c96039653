"""A rank builds only its own shard: the lab's shard-only build (refimpl.lab.rank_build, the CLI's;
refimpl.model.init; issue 35).

The values a rank makes one tensor at a time are the ones `single`'s whole model has (the
strategies' equivalence tests check whole runs; these check the pieces), the rank it builds is the
one the core's build (refimpl.train.place_seeded: the whole reference, cut) makes, and a ZeRO-3
rank's resident memory does not grow by the whole model while it is built.
"""
import re
from dataclasses import replace

import pytest
import torch

from refimpl import launch
from refimpl.config import TrainConfig
from refimpl.lab.rank_build.values import RankValues, check_state, materialize, set_data
from refimpl.mesh import Mesh, ParallelDims
from refimpl.model import GPTConfig, build_model
from refimpl.model.init import init_rules, initial_value
from refimpl.placement import Shard, placement_of, set_placement

TINY = GPTConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=8, n_experts=2)


def test_a_parameter_drawn_alone_is_the_whole_models():
    """Any parameter, made by itself, is the value build_model gives it: the same rule, the same
    generator; a tied weight draws its first name's values; the global RNG is untouched."""
    state = torch.get_rng_state()
    whole = build_model(TINY, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    rules = init_rules(build_model(TINY, seed=3, device="meta"))
    for name, t in whole.state_dict().items():
        assert torch.equal(initial_value(rules[name], t.shape, 3), t), name
    assert not torch.equal(build_model(TINY, seed=4).blocks[0].attn.q.weight,
                           whole.blocks[0].attn.q.weight)
    tied = build_model(GPTConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32, seq_len=4,
                                 tie_embeddings=True), seed=0)
    assert tied.lm_head.weight is tied.embed.tok.weight


def test_a_sharded_tensor_gets_its_slice_and_keeps_its_placement():
    """A meta parameter placed Shard("tp", 1) on tp rank 1 of 2 (a row-parallel W_O) becomes
    that slice of the checkpoint's tensor, on the device, in a tensor of its own, and stays the
    same Parameter object with its placement."""
    mesh = Mesh(ParallelDims(tp=2), 1)    # no process group needed: sizes and indices only
    state = build_model(TINY, seed=0).state_dict()
    values = RankValues(build_model(TINY, seed=0, device="meta"), 0, mesh, "cpu", state)
    weight = torch.nn.Parameter(torch.empty(32, 16, device="meta"))
    set_placement(weight, Shard("tp", 1, 32))
    param = weight
    set_data(weight, values.placed("blocks.0.attn.o.weight", weight))
    assert weight is param and weight.device.type == "cpu"
    assert torch.equal(weight, state["blocks.0.attn.o.weight"][:, 16:])
    assert weight.is_contiguous() and weight.untyped_storage().nbytes() == weight.nbytes
    assert placement_of(weight) == Shard("tp", 1, 32)


def test_materialize_fills_a_whole_model_with_single_s_values():
    reference = build_model(TINY, seed=5, device="meta")
    placed = materialize(reference, RankValues(reference, 5, Mesh(ParallelDims(), 0), "cpu"))
    for (name, a), b in zip(placed.state_dict().items(), build_model(TINY, 5).state_dict().values()):
        assert a.device.type == "cpu" and torch.equal(a, b), name


def test_a_checkpoint_that_is_not_the_models_is_refused():
    shapes = {n: t.shape for n, t in build_model(TINY, 0, device="meta").state_dict().items()}
    state = build_model(TINY, 0).state_dict()
    with pytest.raises(RuntimeError, match="missing"):
        check_state({k: v for k, v in state.items() if k != "lm_head.weight"}, shapes)
    state["lm_head.weight"] = state["lm_head.weight"][:-1]
    with pytest.raises(RuntimeError, match="lm_head.weight has shape"):
        check_state(state, shapes)


# --- measured: a ZeRO-3 rank's resident memory while it is built --------------------------------

# 16 blocks of d = 256: ~51 MB of fp32 weights, one block ~3 MB of it.
WIDE = GPTConfig(n_layers=16, d_model=256, n_heads=4, vocab_size=256, seq_len=16)


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def _build_growth(rank: int, world_size: int, cfgs: list) -> list[dict]:
    """For each configuration in turn: the most this rank's resident memory grew while
    the lab's setup_rank built it (the kernel's high-water mark, reset first by writing 5 to clear_refs),
    and the shards it kept. The strategy is dropped before the next."""
    from refimpl.lab.instrument.model_state import shard_state
    from refimpl.lab.loop import setup_rank
    from refimpl.registry import resolve

    out = []
    for cfg in cfgs:
        layout = resolve(cfg)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _kib("VmRSS")
        _, strategy, n_params = setup_rank(rank, world_size, layout)
        growth = (_kib("VmHWM") - before) * 1024
        kept = shard_state(strategy)
        out.append({"growth": growth, "kept": int(kept.params + kept.grads), "n_params": n_params})
        del strategy
    return out


@pytest.mark.ranks
@pytest.mark.full       # ~10-20 s on 2 shared cores: a launch, three builds
def test_a_zero3_rank_does_not_grow_by_the_whole_model():
    """Two ZeRO-3 ranks of a 51 MB model: each keeps half the parameters and half their
    gradients (the whole model's bytes, together), and while it is built its memory grows by
    little more than that beyond what a tiny model's rank grows by (the process groups, code
    paged in on first use: the tiny model is built twice, the first time to page it all in). A
    rank that built the whole reference first (before issue 35) grew by most of a model more,
    past this bound."""
    tiny = TrainConfig(strategy="zero3", nproc=2, model=replace(TINY, n_experts=0), seq_len=8,
                       device="cpu")
    wide = tiny.with_(model=WIDE, seq_len=16)
    for _, small, r in launch.run(_build_growth, 2, [tiny, tiny, wide], backend="gloo",
                                  timeout=120, quiet=True):
        whole = 4 * r["n_params"]
        assert r["kept"] == pytest.approx(whole, rel=1e-3)
        assert r["growth"] - small["growth"] < r["kept"] + whole / 2, (r, small)


def _both_builds(rank: int, world_size: int, cfgs: list) -> list[list]:
    """Each configuration's rank built both ways, the core's and the lab's (refimpl.train.setup_rank
    with its own `place_seeded`; refimpl.lab.loop.setup_rank): what a step then gives, and the full
    state after it."""
    from refimpl import train
    from refimpl.lab.checkpoint.full_state import full_state_dict
    from refimpl.lab.loop import setup_rank
    from refimpl.model import synthetic_batch
    from refimpl.registry import resolve

    out = []
    for cfg in cfgs:
        layout, built = resolve(cfg), []
        for setup in (train.setup_rank, setup_rank):
            _, strategy, n_params = setup(rank, world_size, layout)
            loss = strategy.train_step(synthetic_batch(cfg.model, cfg.global_batch, cfg.seq_len,
                                                       cfg.seed, 0))
            built.append((n_params, float(loss), full_state_dict(strategy)))
        out.append(built)
    return out


@pytest.mark.ranks
def test_the_shard_only_build_places_what_the_whole_build_places():
    """ZeRO's flat buffer and ZeRO-3's shards written one parameter at a time after the strategy
    was set up on values-less parameters (offloaded too), tensor parallelism's slices, experts over
    ep: the same rank as the reference built whole and cut, bit for bit, after a step too."""
    base = TrainConfig(nproc=2, model=replace(TINY, n_experts=0), seq_len=8, device="cpu",
                       global_batch=4, dtype="float64")
    cfgs = [base.with_(strategy="zero1"), base.with_(strategy="zero2", options={"offload": True}),
            base.with_(strategy="zero3"), base.with_(strategy="fsdp", options={"offload": True}),
            base.with_(strategy="tp", sequence_parallel=True),
            base.with_(strategy="zero2", model=TINY, ep=2)]
    for per_cfg in zip(*launch.run(_both_builds, 2, cfgs, backend="gloo", timeout=300,
                                   quiet=True)):
        for core, lab in per_cfg:      # each rank's: (n_params, loss, state)
            assert core[:2] == lab[:2]
            assert core[2].keys() == lab[2].keys()
            assert all(torch.equal(core[2][k], lab[2][k]) for k in core[2])


def test_a_hook_registered_on_the_shapes_survives_the_values():
    """Tensor parallelism registers gradient hooks while the rank is still shapes (meta):
    they must fire on the placed tensor."""
    t = torch.nn.Parameter(torch.empty(3, device="meta"))
    t.register_hook(lambda grad: grad * 10)
    seen = []
    t.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    set_data(t, torch.ones(3))
    (2 * t).sum().backward()
    assert torch.equal(t.grad, torch.full((3,), 20.0)) and torch.equal(seen[0], t.grad)
