"""The reference model and its data: deterministic, learnable, independent of world size."""
import pytest
import torch

from refimpl.config import TrainConfig
from refimpl.model import GPTConfig, build_model, count_params, lm_loss, synthetic_batch
from refimpl.train import train_on_ranks

CFG = GPTConfig()


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = build_model(CFG, 0), build_model(CFG, 0), build_model(CFG, 1)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(),
                                  c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].attn.q.weight, c.blocks[0].attn.q.weight)


def test_building_the_model_does_not_disturb_the_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_model(CFG, 0)
    assert torch.equal(torch.rand(3), expected)


def test_default_model_is_in_the_test_size_range_and_does_not_divide_by_three():
    n = count_params(build_model(CFG, 0))
    assert 1_000_000 <= n <= 4_000_000
    assert n % 3 != 0      # a 3-rank flat shard must pad: the uneven case is exercised by default


def test_tied_embeddings_share_one_tensor():
    cfg = GPTConfig(tie_embeddings=True)
    m = build_model(cfg, 0)
    assert m.lm_head.weight is m.embed.tok.weight
    assert count_params(m) == count_params(build_model(CFG, 0)) - cfg.vocab_size * cfg.d_model


def test_global_batch_is_deterministic_and_its_shards_tile_it():
    b1 = synthetic_batch(CFG, 12, 16, seed=3, step=2)
    b2 = synthetic_batch(CFG, 12, 16, seed=3, step=2)
    assert torch.equal(b1.inputs, b2.inputs) and torch.equal(b1.targets, b2.targets)
    assert not torch.equal(b1.inputs, synthetic_batch(CFG, 12, 16, seed=3, step=3).inputs)
    for n in (1, 2, 3, 4):
        shards = [b1.shard(r, n) for r in range(n)]
        assert torch.equal(torch.cat([s.inputs for s in shards]), b1.inputs)
    assert torch.equal(b1.inputs[:, 1:], b1.targets[:, :-1])   # targets are inputs shifted
    with pytest.raises(ValueError, match="not divisible"):
        b1.shard(0, 5)


def test_causal_attention_does_not_look_ahead():
    m = build_model(CFG, 0).eval()
    x = synthetic_batch(CFG, 1, 16, seed=0, step=0).inputs
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % CFG.vocab_size      # change only the future
    with torch.no_grad():
        assert torch.allclose(m(x)[0, :10], m(y)[0, :10])


def test_initial_loss_is_ln_vocab_and_training_lowers_it():
    m = build_model(CFG, 0)
    b = synthetic_batch(CFG, 8, 32, seed=0, step=0)
    assert abs(lm_loss(m(b.inputs), b.targets).item() - torch.log(torch.tensor(512.0)).item()) < 0.1
    losses = train_on_ranks(TrainConfig(steps=30))["losses"]
    # each step sees a new batch, so compare averages rather than two noisy points
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_heads_must_divide_the_model_width():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=160, n_heads=7)
