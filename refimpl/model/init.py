"""The reference's initial values, one parameter at a time, each from its own seeded generator."""
from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.nn as nn

from refimpl.model.rmsnorm import RMSNorm

STD = 0.02
NORMAL, ZEROS, ONES = "normal", "zeros", "ones"
# The initialisers a model's constructors call (nn.Linear, nn.Embedding, nn.LayerNorm).
INITIALISERS = ("normal_", "uniform_", "zeros_", "ones_", "kaiming_uniform_", "trunc_normal_")


@contextlib.contextmanager
def values_not_drawn():
    """nn.init's initialisers as no-ops while a model is built: its values come from
    `initial_value` afterwards, and on `meta` the calls cost time (docs/core_notes_model.md)."""
    originals = {name: getattr(nn.init, name) for name in INITIALISERS}
    for name in INITIALISERS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


def init_rules(model: nn.Module) -> dict[str, tuple[str, str]]:
    """Name -> (how its value is drawn, the name seeding its generator) for every parameter under
    every name (a tied weight draws its first name's values) and every buffer."""
    canonical = {id(p): name for name, p in model.named_parameters()}   # first name of a tied one
    rules = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            rules[name] = (_kind(module, local, name), canonical[id(p)])
    for name, _ in model.named_buffers():
        rules[name] = (ZEROS, name)
    return rules


def _kind(module: nn.Module, local: str, name: str) -> str:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return NORMAL if local == "weight" else ZEROS
    if isinstance(module, (nn.LayerNorm, RMSNorm)):   # Llama's RMSNorm: a gain only
        return ONES if local == "weight" else ZEROS
    raise ValueError(f"no initial value for {name} ({type(module).__name__}.{local})")


def initial_value(rule: tuple[str, str], shape, seed: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One tensor's initial value on the host, whole: drawn in fp32, then cast (a float64 run starts
    from the fp32 run's values)."""
    kind, key = rule
    if kind == ZEROS:
        return torch.zeros(shape, dtype=dtype, device="cpu")
    if kind == ONES:
        return torch.ones(shape, dtype=dtype, device="cpu")
    # 32 bits of a digest of seed and name, the same in every process (docs/core_notes_model.md)
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:4], "little"))
    drawn = torch.empty(shape, dtype=torch.float32, device="cpu")
    return drawn.normal_(0.0, STD, generator=generator).to(dtype)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter and buffer of `model` (real tensors) set to its initial value, in place."""
    rules = init_rules(model)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t.copy_(initial_value(rules[name], t.shape, seed, t.dtype))
    return model
