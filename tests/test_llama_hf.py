"""refimpl's Llama and Mixtral against a reference no one here wrote: Hugging Face transformers'
LlamaForCausalLM and MixtralForCausalLM, with the same weights, in float64.

Same logits, same loss, same gradients (relative error <= 1e-10), on small configs built here
(nothing is downloaded); and the checkpoint round trip both ways through `save_pretrained`'s
folder format (refimpl.lab.checkpoint.hf).

One thing of transformers' is changed for the float64 comparison, and the tests say so:
transformers computes RMSNorm's statistic and Mixtral's router softmax in float32 whatever the
model's dtype (right for bf16, a downcast in float64), so `float64_casts` swaps those two
forwards for the same formulas without the cast. The rotary angles need no swap: refimpl computes
them in float32 as transformers does (refimpl.model.rotary). `test_as_shipped` runs transformers
untouched and finds the difference at float32's size, which is what the swap accounts for.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from refimpl.lab.checkpoint.hf import config_from_hf, hf_config, hub_name, load_hf, save_hf  # noqa: E402
from refimpl.model import GPTConfig, build_model, lm_loss, synthetic_batch  # noqa: E402

LLAMA = GPTConfig(arch="llama", vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_kv_heads=2,
                  n_layers=2, ffn_hidden=48, rope_theta=500000.0, norm_eps=1e-6)
# dropless (capacity E/k: nothing overflows, as in Mixtral), no balance loss (see refimpl.lab.checkpoint.hf)
MIXTRAL = GPTConfig(arch="llama", vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_kv_heads=1,
                    n_layers=2, ffn_hidden=40, n_experts=4, top_k=2, capacity_factor=2.0,
                    balance="none", rope_theta=1e6)


@contextlib.contextmanager
def float64_casts():
    """transformers' RMSNorm and Mixtral router without their float32 casts (see the docstring)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mixtral import modeling_mixtral

    def rms_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def router_forward(self, x):
        x = x.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(x, self.weight)
        top, index = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index

    swaps = [(modeling_llama.LlamaRMSNorm, "forward", rms_forward),
             (modeling_mixtral.MixtralRMSNorm, "forward", rms_forward),
             (modeling_mixtral.MixtralTopKRouter, "forward", router_forward)]
    saved = [(cls, name, getattr(cls, name)) for cls, name, _ in swaps]
    try:
        for cls, name, fn in swaps:
            setattr(cls, name, fn)
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


# transformers' default expert kernel (grouped_mm) takes no float64: its loop over experts does
_EAGER_EXPERTS = {"experts_implementation": "eager"}


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="sdpa", **_EAGER_EXPERTS).eval()


def _ours_and_theirs(cfg, tmp_path):
    ours = build_model(cfg, seed=3).to(torch.float64)
    return ours, _hf_model(save_hf(ours, cfg, tmp_path / "ckpt"))


def _relative(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def _compare(ours, theirs, cfg):
    batch = synthetic_batch(cfg, 4, cfg.seq_len, seed=5, step=0)
    ours_logits = ours(batch.inputs)
    theirs_logits = theirs(input_ids=batch.inputs).logits
    lm_loss(ours_logits, batch.targets).backward()
    lm_loss(theirs_logits, batch.targets).backward()
    grads = {hub_name(n): p.grad for n, p in ours.named_parameters()}
    errors = {n: _relative(grads[n], p.grad) for n, p in theirs.named_parameters()
              if n in grads}
    return _relative(ours_logits, theirs_logits), errors


@pytest.mark.parametrize("cfg", [LLAMA, MIXTRAL], ids=["llama", "mixtral"])
def test_logits_loss_and_gradients_equal_transformers_in_float64(cfg, tmp_path):
    ours, theirs = _ours_and_theirs(cfg, tmp_path)
    if cfg.n_experts:   # transformers fuses each layer's experts into gate_up_proj / down_proj
        compared = _compare_fused(ours, theirs, cfg)
    else:
        with float64_casts():
            compared = _compare(ours, theirs, cfg)
    logits_error, grad_errors = compared
    assert logits_error <= 1e-10, logits_error
    assert len(grad_errors) >= 9 * cfg.n_layers // (2 if cfg.n_experts else 1)
    worst = max(grad_errors, key=grad_errors.get)
    assert grad_errors[worst] <= 1e-10, (worst, grad_errors[worst])


def _compare_fused(ours, theirs, cfg):
    """Mixtral: compare the fused expert tensors' gradients with refimpl's per-expert ones."""
    with float64_casts():
        logits_error, errors = _compare(ours, theirs, cfg)
    named = dict(theirs.named_parameters())
    for i in range(cfg.n_layers):
        experts = ours.blocks[i].mlp.experts
        ours_gate_up = torch.stack([torch.cat([experts[str(e)].gate.weight.grad,
                                               experts[str(e)].up.weight.grad])
                                    for e in range(cfg.n_experts)])
        ours_down = torch.stack([experts[str(e)].down.weight.grad for e in range(cfg.n_experts)])
        prefix = f"model.layers.{i}.mlp.experts."
        errors[prefix + "gate_up_proj"] = _relative(ours_gate_up, named[prefix + "gate_up_proj"].grad)
        errors[prefix + "down_proj"] = _relative(ours_down, named[prefix + "down_proj"].grad)
    return logits_error, errors


def test_as_shipped_the_difference_is_float32s(tmp_path):
    # transformers untouched: its float32 RMSNorm makes the logits differ at float32's size,
    # far above float64's 1e-16 and far below a wrong formula's O(1).
    ours, theirs = _ours_and_theirs(LLAMA, tmp_path)
    batch = synthetic_batch(LLAMA, 2, LLAMA.seq_len, seed=5, step=0)
    error = _relative(ours(batch.inputs), theirs(input_ids=batch.inputs).logits)
    assert 1e-12 < error < 1e-5, error


def test_a_checkpoint_transformers_wrote_loads_and_goes_back(tmp_path):
    # transformers builds and saves its own random Mixtral; refimpl loads it, gives its logits,
    # writes it back, and transformers reloads exactly the tensors it wrote.
    config = transformers.MixtralConfig(**{k: v for k, v in hf_config(MIXTRAL).items()
                                           if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).to(torch.float64).save_pretrained(tmp_path / "theirs")
    original = _hf_model(tmp_path / "theirs")     # sdpa attention, eager experts, as below
    ours, cfg = load_hf(tmp_path / "theirs")
    assert cfg == config_from_hf(hf_config(MIXTRAL)) and cfg.capacity_factor == cfg.n_experts / cfg.top_k
    batch = synthetic_batch(cfg, 2, cfg.seq_len, seed=1, step=0)
    with torch.no_grad(), float64_casts():
        assert _relative(ours(batch.inputs), original(input_ids=batch.inputs).logits) <= 1e-10
    reloaded = _hf_model(save_hf(ours, cfg, tmp_path / "back"))
    before, after = original.state_dict(), reloaded.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_parameter_counts_equal_transformers():
    # refimpl's model and transformers' for the same config count the same parameters
    from refimpl.model import count_params
    for cfg, cls in [(LLAMA, transformers.LlamaForCausalLM), (MIXTRAL, transformers.MixtralForCausalLM)]:
        config = getattr(transformers, cls.__name__.replace("ForCausalLM", "Config"))(
            **{k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "model_type")})
        with torch.device("meta"):
            theirs = sum(p.numel() for p in cls(config).parameters())
            ours = count_params(build_model(cfg, seed=0))
        assert ours == theirs, (cfg, ours, theirs)


@pytest.mark.parametrize("name", ["llama2-7b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b",
                                  "mixtral-8x7b", "mixtral-8x22b"])
def test_preset_counts_equal_transformers(name):
    # the planner's presets (refimpl.lab.predict.presets) against transformers' own count of the same
    # published config, to the parameter (models built on the meta device: no memory)
    from refimpl.lab.predict.presets import MODELS
    shape, _ = MODELS[name]
    common = dict(vocab_size=shape.vocab_size, hidden_size=shape.d_model,
                  intermediate_size=shape.mlp_width, num_hidden_layers=shape.n_layers,
                  num_attention_heads=shape.n_heads,
                  num_key_value_heads=shape.kv_heads or shape.n_heads,
                  tie_word_embeddings=shape.tied_embeddings)
    if shape.n_experts:
        config, cls = (transformers.MixtralConfig(num_local_experts=shape.n_experts,
                                                  num_experts_per_tok=shape.top_k, **common),
                       transformers.MixtralForCausalLM)
    else:
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    with torch.device("meta"):
        theirs = sum(p.numel() for p in cls(config).parameters())
    assert shape.n_params == theirs, (name, shape.n_params, theirs)


@pytest.mark.ranks
def test_a_transformers_llama_trained_by_refimpl_goes_back_to_transformers(tmp_path):
    # transformers builds and saves a tiny random Llama; refimpl trains it 3 steps from that
    # folder under zero1 x tp2 x pp2 (--init-hf: each rank reads the tensors it places), saves it
    # back; transformers reloads it and gives the logits refimpl's trained model gives.


    from refimpl.lab.checkpoint.hf import read_config
    from refimpl.lab.config import LabConfig
    from refimpl.train import train_on_ranks

    cfg = replace(LLAMA, n_layers=4)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(cfg).items()
                                         if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.float64).save_pretrained(tmp_path / "theirs")
    model = read_config(tmp_path / "theirs")
    assert model == cfg
    run = LabConfig(strategy="zero1", nproc=4, tp=2, pp=2, steps=3, global_batch=4,
                    micro_batches=2, seq_len=cfg.seq_len, dtype="float64", model=model,
                    init_hf=str(tmp_path / "theirs"), return_state=True)
    trained = train_on_ranks(run, timeout=300)
    start, _ = load_hf(tmp_path / "theirs")
    ours = build_model(model, seed=0).to(torch.float64)
    ours.load_state_dict(trained["state_dict"])
    assert max(float((p - start.state_dict()[n]).abs().max())
               for n, p in ours.named_parameters()) > 1e-4    # it trained: the weights moved
    reloaded = _hf_model(save_hf(ours, model, tmp_path / "back"))
    batch = synthetic_batch(model, 2, model.seq_len, seed=9, step=0)
    with torch.no_grad(), float64_casts():
        error = _relative(ours(batch.inputs), reloaded(input_ids=batch.inputs).logits)
    assert error <= 1e-10, error
    # and the run's first loss is that of transformers' own weights on the first batch
    first = synthetic_batch(model, 4, model.seq_len, seed=run.seed, step=0)
    with torch.no_grad(), float64_casts():
        theirs = lm_loss(_hf_model(tmp_path / "theirs")(input_ids=first.inputs).logits,
                         first.targets)
    assert abs(trained["losses"][0] - float(theirs)) <= 1e-10


def test_a_tied_llama_round_trips_and_a_biased_one_is_refused(tmp_path):
    # tied: transformers stores the embedding once, lm_head reads it; a config with biases
    # (attention_bias, as Qwen's) would lose them silently, so it is refused in one line
    import json

    cfg = replace(LLAMA, tie_embeddings=True)
    ours = build_model(cfg, seed=1).to(torch.float64)
    path = save_hf(ours, cfg, tmp_path / "tied")
    back, _ = load_hf(path)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ValueError, match="no biases"):
        load_hf(path)


class _Mesh:
    """The two questions refimpl.placement asks a mesh, for a rank `index` of `size` on every axis."""

    def __init__(self, size: int, index: int):
        self._size, self._index = size, index

    def size(self, axis):
        return self._size

    def index(self, axis):
        return self._index


def test_init_hf_reads_only_the_slice_a_rank_keeps(tmp_path):
    # --init-hf places from BoxedParts(HubState): each rank's part is read as a box of the file
    # (safetensors' get_slice), equal to cutting the whole tensor, and the bytes it holds are its
    # part's alone (a view of a whole tensor read first would hold all of it)
    from refimpl.lab.checkpoint.gather import local_part
    from refimpl.lab.checkpoint.hf import HubState
    from refimpl.lab.checkpoint.shard_boxes import BoxedParts
    from refimpl.placement import Shard

    ours = build_model(LLAMA, seed=2).to(torch.float64)
    path = save_hf(ours, LLAMA, tmp_path / "ckpt")
    whole = ours.state_dict()
    state = BoxedParts(HubState(path, build_model(LLAMA, seed=0, device="meta")))
    d, kv = LLAMA.d_model, LLAMA.n_kv_heads * LLAMA.d_model // LLAMA.n_heads
    cases = [("blocks.0.attn.q.weight", Shard("tp", 0, d), (d // 2, d), 2),            # column-parallel
             ("blocks.1.mlp.down.weight", Shard("tp", 1, LLAMA.ffn_hidden), (d, LLAMA.ffn_hidden // 2), 2),
             ("blocks.0.attn.k.weight", Shard("tp", 0, kv, repeats=2), (kv // 2, d), 4),  # 2 heads, 4 ranks
             ("embed.tok.weight", Shard("tp", 0, LLAMA.vocab_size), (40, d), 3)]        # 120 rows: padded
    for name, where, shape, size in cases:
        assert state.shape_of(name) == tuple(whole[name].shape)
        for r in range(size):
            part = state.read_part(name, shape, where, _Mesh(size, r))
            assert torch.equal(part, local_part(whole[name], shape, where, _Mesh(size, r))), (name, r)
            assert part.untyped_storage().nbytes() == part.nbytes, (name, r)
