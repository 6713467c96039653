"""Ring attention (refimpl.parallel.cp.ring) against full causal attention, on 2 and 4 gloo ranks.

Each rank builds the same full Q, K, V from one seed, keeps its slice of the sequence, runs ring
attention forward and backward with its slice of one fixed output gradient, and hands back its
output and gradients; the test reassembles the slices and compares them with
refimpl.model.attention on the whole sequence.
"""
import pytest
import torch

from refimpl.lab.measure.cp_measure import counted_ring_attention, score_blocks_per_rank, unshard_sequence
from refimpl.lab.measure.moe_collectives import ring_hops
from refimpl.launch import run
from refimpl.model import attention
from refimpl.parallel.cp.ring import chunk_ids, shard_sequence
from tests.models import SMALL

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

BATCH, SEQ, HEADS, HEAD_DIM = 2, 32, 4, 8


def _full_inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(BATCH, SEQ, HEADS * HEAD_DIM, generator=g) for _ in range(4))
    return q, k, v, grad


def _ring_rank(rank: int, world: int, balanced: bool) -> dict:
    import torch.distributed as dist

    from refimpl.lab.instrument.labels import CommLog

    group = dist.new_group(list(range(world)))
    q, k, v, grad = (shard_sequence(t, rank, world, balanced=balanced) for t in _full_inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with CommLog() as forward:
        out, blocks = counted_ring_attention(q, k, v, HEADS, group, balanced=balanced)
    with CommLog() as backward:
        out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "score_blocks": blocks,
            "messages": {"forward": forward.messages["cp"], "backward": backward.messages["cp"]}}


def _reference():
    q, k, v, grad = _full_inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, HEADS)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("world,balanced", [(2, True), (4, True), (4, False)])
def test_ring_attention_equals_full_attention(reference, world, balanced):
    results = run(_ring_rank, world, balanced)
    for name in ("out", "dq", "dk", "dv"):
        got = unshard_sequence([r[name] for r in results], balanced=balanced)
        want = reference[name]
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= 1e-5, f"{name}: relative error {rel:.2e} (cp={world}, balanced={balanced})"
    # the blocks each rank computed are the ones the work model counts
    assert [r["score_blocks"] for r in results] == score_blocks_per_rank(world, balanced)
    # and the messages each rank sent are the hops refimpl.lab.measure.moe_collectives counts
    assert all(r["messages"] == ring_hops(world) for r in results), [r["messages"] for r in results]


def test_head_tail_balance_equalises_work():
    for cp in (2, 4, 8):
        balanced, contiguous = score_blocks_per_rank(cp, True), score_blocks_per_rank(cp, False)
        assert len(set(balanced)) == 1 and balanced[0] == 2 * cp + 1
        assert max(contiguous) > min(contiguous)
        assert contiguous == [4 * r + 3 for r in range(cp)]
        # the same total: the balance moves work, it does not remove any
        assert sum(balanced) == sum(contiguous)


def test_sequence_layout_round_trip():
    x = torch.arange(2 * 16).view(2, 16)
    for balanced in (True, False):
        parts = [shard_sequence(x, r, 4, balanced=balanced) for r in range(4)]
        assert torch.equal(unshard_sequence(parts, balanced=balanced), x)
    assert chunk_ids(0, 4) == (0, 7) and chunk_ids(3, 4) == (3, 4)
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        shard_sequence(torch.zeros(1, 12), 0, 4)


def test_one_rank_is_plain_causal_attention(reference):
    from refimpl.parallel.cp.ring import ring_attention

    q, k, v, grad = _full_inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, HEADS, None)
    out.backward(grad)
    for name, got in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(got, reference[name], rtol=1e-5, atol=1e-6)


# --- through the loop: `--cp` with any data-parallel flavour on dp x cp ---------------------------

@pytest.mark.parametrize("strategy,nproc,cp,checkpointing", [
    ("dp", 2, 2, True),      # the ring runs again inside each block's recomputed forward
    # 4 ranks: make test-full's (the layout matrix runs cp with every flavour in make test)
    pytest.param("dp", 4, 4, False, marks=pytest.mark.full),
    pytest.param("zero2", 4, 2, False, marks=pytest.mark.full),  # dp2 x cp2: ZeRO shards over all four
])
def test_loop_with_context_parallel_equals_single(strategy, nproc, cp, checkpointing):
    """In float64 ring attention's reordered softmax sums cost ~1e-16 each: the whole model after
    3 AdamW steps is single's to the 1e-9 gate (in fp32 the same reordering, amplified by AdamW,
    leaves ~1.5e-5, whatever the layout: refimpl.lab.verify.equivalence.fp32_noise_floor)."""
    from refimpl.lab.config import LabConfig
    from refimpl.lab.predict.cp_comm import rank_activation_bytes
    from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_with_single
    from refimpl.train import train_on_ranks

    cfg = LabConfig(strategy=strategy, nproc=nproc, cp=cp, steps=3, return_state=True,
                    activation_checkpointing=checkpointing, dtype="float64", model=SMALL)
    run = train_on_ranks(cfg)
    eq = compare_with_single(cfg, run)
    assert eq.tolerance == FP64_TOLERANCE and eq.ok, eq
    if not checkpointing:   # what each rank saved for backward: ring attention's count, to the byte
        rows = cfg.global_batch // (nproc // cp * cfg.micro_batches)
        want = rank_activation_bytes(SMALL, rows, cfg.seq_len, cp, dtype_bytes=8,
                                     id_rows=rows * cfg.micro_batches)
        assert [m["activations_peak"] for m in run["memory"]] == [want] * nproc


def test_sequence_must_split_into_2cp_chunks():
    from refimpl.config import TrainConfig
    from refimpl.mesh import LayoutError
    from refimpl.train import validate

    with pytest.raises(LayoutError, match="divisible by 2 x cp = 8"):
        validate(TrainConfig(strategy="dp", nproc=4, cp=4, seq_len=36))
