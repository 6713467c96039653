"""Hugging Face checkpoints in and out: refimpl's Llama and Mixtral as `transformers` stores them.

A checkpoint folder, as `save_pretrained` writes it: `config.json` (the architecture) and one or
more `*.safetensors` files (the tensors by name; `model.safetensors.index.json` says which file
holds which tensor when there are several). Nothing here imports `transformers`: the format is
JSON and safetensors, read and written with the `safetensors` package, one tensor at a time
(`HubState`: what `--init-hf` places, each rank reading the tensors it keeps).

Names, refimpl's (left) and the Hub's (right; `i` a block, `e` an expert):

    embed.tok.weight                    model.embed_tokens.weight
    blocks.i.ln1.weight                 model.layers.i.input_layernorm.weight
    blocks.i.attn.{q,k,v,o}.weight      model.layers.i.self_attn.{q,k,v,o}_proj.weight
    blocks.i.ln2.weight                 model.layers.i.post_attention_layernorm.weight
    blocks.i.mlp.{gate,up,down}.weight  model.layers.i.mlp.{gate,up,down}_proj.weight
    blocks.i.mlp.router.weight          model.layers.i.block_sparse_moe.gate.weight
    blocks.i.mlp.experts.e.gate.weight  model.layers.i.block_sparse_moe.experts.e.w1.weight
    blocks.i.mlp.experts.e.up.weight    model.layers.i.block_sparse_moe.experts.e.w3.weight
    blocks.i.mlp.experts.e.down.weight  model.layers.i.block_sparse_moe.experts.e.w2.weight
    final_norm.weight                   model.norm.weight
    lm_head.weight                      lm_head.weight

(Mixtral's experts are stored one matrix per file entry, w1 = gate, w3 = up, w2 = down, as its
released checkpoints are; transformers 5 fuses them into gate_up_proj when it loads, and writes
this form back.) A Mixtral loads with every expert's capacity at E/k (nothing can overflow:
Mixtral is dropless) and balance "none": transformers' router loss pools every layer's tokens
into one f·P sum, which is not refimpl's per-layer Switch loss, so a run that wants a balance
loss chooses it.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from refimpl.model.config import GPTConfig
from refimpl.model.gpt import build_model

_BLOCK = [   # refimpl's name inside a block -> the Hub's, inside model.layers.i
    ("ln1.weight", "input_layernorm.weight"),
    ("attn.q.weight", "self_attn.q_proj.weight"),
    ("attn.k.weight", "self_attn.k_proj.weight"),
    ("attn.v.weight", "self_attn.v_proj.weight"),
    ("attn.o.weight", "self_attn.o_proj.weight"),
    ("ln2.weight", "post_attention_layernorm.weight"),
    ("mlp.gate.weight", "mlp.gate_proj.weight"),
    ("mlp.up.weight", "mlp.up_proj.weight"),
    ("mlp.down.weight", "mlp.down_proj.weight"),
    ("mlp.router.weight", "block_sparse_moe.gate.weight"),
]
_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}
_TOP = {"embed.tok.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}


def hub_name(name: str) -> str:
    """The Hub's name of refimpl's parameter `name` (ValueError for one the Hub has not)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m:
        i, inner = m.groups()
        e = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)\.weight", inner)
        if e:
            return f"model.layers.{i}.block_sparse_moe.experts.{e[1]}.{_EXPERT[e[2]]}.weight"
        for ours, theirs in _BLOCK:
            if inner == ours:
                return f"model.layers.{i}.{theirs}"
    raise ValueError(f"{name!r} has no Hugging Face name (an --arch llama model's parameter?)")


# --- config.json ----------------------------------------------------------------------------------

def hf_config(cfg: GPTConfig) -> dict:
    """config.json for `cfg` (an --arch llama model): LlamaConfig's fields, or MixtralConfig's."""
    if cfg.arch != "llama":
        raise ValueError("only --arch llama models have a Hugging Face form (GPT-2's block differs)")
    config = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.swiglu_hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters, 4.x rope_theta: both, the same value
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
    }
    if cfg.n_experts:
        config.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
                      num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                      router_jitter_noise=0.0, output_router_logits=False)
    else:
        config.update(model_type="llama", architectures=["LlamaForCausalLM"], mlp_bias=False)
    return config


def config_from_hf(config: dict) -> GPTConfig:
    """refimpl's GPTConfig for a Hugging Face config.json (Llama or Mixtral)."""
    kind = config.get("model_type")
    if kind not in ("llama", "mixtral"):
        raise ValueError(f"model_type {kind!r}: refimpl reads Llama and Mixtral checkpoints")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias: refimpl's Llama block has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r}: refimpl's SwiGLU uses silu")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError("head_dim x num_attention_heads != hidden_size: refimpl's attention "
                         "keeps h = heads x head_dim")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError("rope scaling (Llama 3.1's long context) is not implemented; refimpl "
                         "rotates by the default angles")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    experts = config.get("num_local_experts", 0) if kind == "mixtral" else 0
    top_k = config.get("num_experts_per_tok", 2)
    extra = dict(n_experts=experts, top_k=top_k, capacity_factor=experts / top_k,
                 balance="none") if experts else {}
    return GPTConfig(arch="llama", vocab_size=config["vocab_size"],
                     seq_len=config["max_position_embeddings"], d_model=config["hidden_size"],
                     n_heads=config["num_attention_heads"],
                     n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
                     n_layers=config["num_hidden_layers"],
                     ffn_hidden=config["intermediate_size"],
                     tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                     rope_theta=float(theta), norm_eps=config.get("rms_norm_eps", 1e-6), **extra)


# --- the tensors ----------------------------------------------------------------------------------

def _files_of(path: Path) -> dict[str, Path]:
    """Hub name -> the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            files.update({name: file for name in f.keys()})
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors file")
    return files


def load_hf(path: str | Path, dtype: torch.dtype | None = None) -> tuple[nn.Module, GPTConfig]:
    """The model and its config from a Hugging Face checkpoint folder (config.json and
    *.safetensors), in the files' dtype unless `dtype` is given. Every parameter must be in the
    files, and every tensor of the files a parameter (`HubState`)."""
    cfg = read_config(path)
    model = build_model(cfg, seed=0, device="meta")     # shapes only: the values are the files'
    state = HubState(path, model)
    tensors = {name: state[name] for name in state}
    stored = {t.dtype for name, t in tensors.items() if name not in state.zeros}
    if dtype is None and len(stored) > 1:   # load_state_dict would cast them silently
        raise ValueError(f"{path}: tensors of several dtypes {sorted(map(str, stored))}: pass dtype=")
    model = model.to_empty(device="cpu").to(dtype or stored.pop())
    model.load_state_dict(tensors)
    return model, cfg


def save_hf(model: nn.Module, cfg: GPTConfig, path: str | Path) -> Path:
    """Write `model` (refimpl's parameter names) as a Hugging Face checkpoint folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {hub_name(name): p.detach().to("cpu").contiguous()
               for name, p in model.named_parameters()}
    dtypes = {t.dtype for t in tensors.values()}
    config = {**hf_config(cfg), "dtype": str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1
              else "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


class HubState(Mapping):
    """A Hugging Face checkpoint folder as refimpl's full state dict, read lazily: `state[name]`
    reads that one tensor from its safetensors file (memory-mapped) when a rank places it, so a
    rank holds one checkpoint tensor at a time (refimpl.lab.rank_build.values), and `box` reads
    only a part of it (what `--init-hf` uses: each rank reads the slices it keeps). The buffers a
    Hub checkpoint has not (a MoE layer's expert_bias) start at zero, as refimpl's own init has them.
    `reference`: the model it is read into (meta is enough), for those buffers' shapes."""

    def __init__(self, path: str | Path, reference: nn.Module):
        self.path = Path(path)
        self.files = _files_of(self.path)
        # a tied lm_head.weight reads the embedding's tensor, as transformers stores it once
        first = {id(p): name for name, p in reference.named_parameters()}
        self.hub = {name: hub_name(first[id(p)])
                    for name, p in reference.named_parameters(remove_duplicate=False)}
        self.zeros = {name: (b.shape, b.dtype) for name, b in reference.named_buffers()}
        # a name left over on either side is an error, not a silent random (or dropped) weight
        extra = sorted(set(self.files) - set(self.hub.values()))
        missing = sorted(h for h in self.hub.values() if h not in self.files)
        if extra or missing:
            raise ValueError(f"{path}: tensors not in refimpl's model {extra[:4]}, parameters "
                             f"not in the files {missing[:4]}")
        self.names = list(self.hub) + list(self.zeros)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.box(name, None, None)

    def shape_of(self, name: str) -> tuple:
        """The tensor's shape, from the file's header: no bytes read."""
        if name in self.zeros:
            return tuple(self.zeros[name][0])
        with safe_open(str(self.files[self._hub(name)]), framework="pt") as f:
            return tuple(f.get_slice(self.hub[name]).get_shape())

    def box(self, name: str, offsets, lengths) -> torch.Tensor:
        """The box (offsets, lengths; None: the whole tensor) of `name`: safetensors reads those
        bytes alone, so a rank that keeps a tp slice of a matrix reads that slice
        (refimpl.lab.checkpoint.shard_boxes.BoxedParts)."""
        if name in self.zeros:
            shape, dtype = self.zeros[name]
            return torch.zeros(shape if lengths is None else lengths, dtype=dtype)
        with safe_open(str(self.files[self._hub(name)]), framework="pt") as f:
            if not offsets:            # the whole tensor, or a 0-d one
                return f.get_tensor(self.hub[name])
            # safetensors maps the file: the slice is a view of the mapped tensor whose pages are
            # read as touched; the clone touches the box's alone and keeps no mapping alive
            box = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
            return f.get_slice(self.hub[name])[box].clone()

    def _hub(self, name: str) -> str:
        if name not in self.hub:
            raise KeyError(name)
        return self.hub[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def read_config(path: str | Path) -> GPTConfig:
    """refimpl's config of the checkpoint folder `path` (its config.json)."""
    config = Path(path) / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"{path}: no config.json (a Hugging Face checkpoint folder has one)")
    return config_from_hf(json.loads(config.read_text()))
