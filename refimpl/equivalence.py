"""The first test of every strategy: does it compute exactly what `single` computes?

Same seed, same global batch, same number of steps: the losses and the final weights must match the
one-process reference (fp32: relative error <= 1e-5; bit-exact where the arithmetic is identical).
`compare_with_single` runs both and reports the worst relative errors, so a notebook can assert
them and a test can assert them on world sizes 2, 4 and one that does not divide evenly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from refimpl.strategy import TrainConfig
from refimpl.train import train_on_ranks

TOLERANCE = 1e-5


@dataclass
class Equivalence:
    strategy: str
    world_size: int
    loss_rel_err: float          # max over steps of |loss - ref| / |ref|
    weight_rel_err: float        # max over tensors of ||w - ref|| / ||ref||
    bit_exact: bool
    losses: list
    reference_losses: list

    @property
    def ok(self) -> bool:
        return self.loss_rel_err <= TOLERANCE and self.weight_rel_err <= TOLERANCE


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare_states(state: dict, reference: dict) -> tuple[float, bool]:
    if state.keys() != reference.keys():
        missing = sorted(set(reference) ^ set(state))
        raise AssertionError(f"state dict keys differ from the reference's: {missing[:5]}")
    worst, exact = 0.0, True
    for name, ref in reference.items():
        got = state[name]
        if got.shape != ref.shape:
            raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
        worst = max(worst, relative_error(got, ref))
        exact = exact and torch.equal(got, ref)
    return worst, exact


_reference_cache: dict = {}


def reference_run(cfg: TrainConfig) -> dict:
    """`single` on the same model, data, steps and micro-batching; cached per configuration."""
    ref_cfg = cfg.with_(strategy="single", nproc=1, return_state=True, profile=False, options={})
    key = repr(ref_cfg)
    if key not in _reference_cache:
        _reference_cache[key] = train_on_ranks(ref_cfg)
    return _reference_cache[key]


def compare_with_single(cfg: TrainConfig, result: dict | None = None) -> Equivalence:
    """Run `cfg` (unless its result is given) and `single`; compare losses and final weights."""
    if result is None:
        result = train_on_ranks(cfg.with_(return_state=True))
    ref = reference_run(cfg)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref["losses"]))
    weight_err, exact = compare_states(result["state_dict"], ref["state_dict"])
    return Equivalence(cfg.strategy, cfg.nproc, loss_err, weight_err,
                       exact and result["losses"] == ref["losses"], result["losses"], ref["losses"])
