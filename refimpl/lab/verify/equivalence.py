"""The first test of every strategy: does it compute exactly what `single` computes?

Same seed, same global batch, same number of steps: the losses and the final weights must match the
one-process reference. The proof runs in float64 (`LabConfig(dtype="float64")`), where a gate at
1e-9 cannot depend on the processor; fp32 runs are gated at a multiple of the processor's own fp32
noise (`fp32_noise_floor`); bit-exact where the arithmetic is the same sequence of operations.
The reference runs on the device the ranks use (`ranks_device`): CPU when they are on gloo, the
GPU when they are on NCCL or share one GPU (the staged backend); on CUDA with TF32 off and
deterministic kernels (refimpl.lab.runtime.numerics), so the same gates hold there (TF32's 10-bit mantissa
would put fp32 near 1e-3).
`compare_with_single` runs both and reports the worst relative errors, so a notebook can assert
them and a test can assert them on world sizes 2, 4 and one that does not divide evenly.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from refimpl.config import TrainConfig
from refimpl.lab.config import LabConfig, lab_config
from refimpl.launch import pick_backend
from refimpl.train import launch_backend, train_on_ranks

SHARED_DEVICE = "REFIMPL_SHARED_DEVICE"      # refimpl.lab.runtime.shared_device.ENV (the staged backend's)

TOLERANCE = 1e-5
# float64: reordered sums differ by ~1e-16 relative and AdamW's amplification leaves the weights
# ~1e-14 apart (measured for every strategy by the equivalence tests); a real bug (a missing
# sync, a wrong scale) moves them by 1e-3 or more. A gate at 1e-9 has >= 1e4 x margin both ways,
# on any processor: this is the gate that proves a layout computes single's maths.
FP64_TOLERANCE = 1e-9
# fp32 runs (notebooks, bf16, comparisons with PyTorch's twins as users run them) are gated at a
# multiple of the processor's own fp32 noise: see weight_tolerance.
FP32_NOISE_FACTOR = 4.0
BF16_TOLERANCE = 2e-2      # bf16 compute: 8 mantissa bits, ~4e-3 per rounding, compared in fp32


def fp32_noise_floor(cfg: TrainConfig) -> float:
    """How far fp32 rounding alone moves `single`'s weights on this processor: the relative
    distance between single's fp32 and float64 runs of the same configuration.

    Splitting a batch or a matmul changes the order of sums (and the BLAS's blocking, which
    depends on the shapes and the processor); AdamW amplifies that ~1e-7 rounding wherever a
    gradient element sits near eps, to ~1e-5 in the weights after a few steps. Any fp32 layout is
    one more such rounding of the same exact (float64) trajectory, so its distance to fp32
    single is at most about twice this floor, whatever the processor."""
    ref32 = reference_run(cfg.with_(dtype="float32"))
    ref64 = reference_run(cfg.with_(dtype="float64"))
    weights, _, _ = compare_states(ref32["state_dict"], ref64["state_dict"])
    return weights


def weight_tolerance(cfg: TrainConfig) -> float:
    """The gate on the whole model's relative weight error for `cfg` against `single`.

    float64: FP64_TOLERANCE. bf16: BF16_TOLERANCE. fp32: max(TOLERANCE, 4 x this processor's fp32
    noise floor), so a gate holds on every CPU while a bug (>= 1e-3) still fails it."""
    if cfg.dtype == "float64":
        return FP64_TOLERANCE
    if cfg.mixed_precision == "bf16":
        return BF16_TOLERANCE
    return max(TOLERANCE, FP32_NOISE_FACTOR * fp32_noise_floor(cfg))


def loss_tolerance(cfg: TrainConfig) -> float:
    """The gate on each step's relative loss error: the losses are sums over the batch, far less
    sensitive than AdamW's weights (fp32 differences measured at ~2e-7)."""
    if cfg.dtype == "float64":
        return FP64_TOLERANCE
    return BF16_TOLERANCE if cfg.mixed_precision == "bf16" else TOLERANCE


@dataclass
class Equivalence:
    strategy: str
    world_size: int
    loss_rel_err: float          # max over steps of |loss - ref| / |ref|
    weight_rel_err: float        # ||w - ref|| / ||ref|| over the whole model as one vector
    worst_tensor_rel_err: float  # the same per tensor, the worst one (reported, not gated)
    bit_exact: bool
    losses: list
    reference_losses: list

    tolerance: float = TOLERANCE           # the weight gate (weight_tolerance)
    loss_tolerance: float = TOLERANCE

    @property
    def ok(self) -> bool:
        return self.loss_rel_err <= self.loss_tolerance and self.weight_rel_err <= self.tolerance

    def row(self) -> dict:
        """One table row for a notebook: the errors beside the gates they are held to."""
        return {"loss rel. err": self.loss_rel_err, "weights rel. err": self.weight_rel_err,
                "weight gate": self.tolerance, "worst single tensor": self.worst_tensor_rel_err,
                "ok": self.ok}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare_states(state: dict, reference: dict) -> tuple[float, float, bool]:
    """(whole-model relative error, worst single tensor's, bit-exact?) of a state dict vs reference.

    The gate is the whole model as one vector. Per tensor, a tensor whose true gradient is ~0
    can drift: Adam divides by sqrt(v), so round-off-sized gradients (which differ between one
    process and N, because sums are taken in another order) become steps of size lr. Such drift
    is real but tiny against the model; the worst tensor is reported so a reader can see it.
    """
    if state.keys() != reference.keys():
        missing = sorted(set(reference) ^ set(state))
        raise AssertionError(f"state dict keys differ from the reference's: {missing[:5]}")
    worst, exact, diff_sq, ref_sq = 0.0, True, 0.0, 0.0
    for name, ref in reference.items():
        got = state[name]
        if got.shape != ref.shape:
            raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
        worst = max(worst, relative_error(got, ref))
        exact = exact and torch.equal(got, ref)
        diff_sq += float((got.double() - ref.double()).pow(2).sum())
        ref_sq += float(ref.double().pow(2).sum())
    return (diff_sq / max(ref_sq, 1e-60)) ** 0.5, worst, exact


# single's runs, by configuration, most recently used last: a notebook or a test module compares
# many layouts with a few references. Bounded, so a long session does not keep every state dict.
_reference_cache: OrderedDict = OrderedDict()
REFERENCE_CACHE_SIZE = 32


def ranks_device(nproc: int, device: str = "auto") -> str:
    """The device type `nproc` ranks of a run with `TrainConfig.device` = `device` compute on:
    "cpu" where the run keeps them on gloo (device "cpu", or too few GPUs), "cuda" under NCCL
    (one GPU per rank), and the shared device's type under the staged backend
    (REFIMPL_SHARED_DEVICE=cuda:0: every rank on that GPU). A reference for them must run there
    too, or a GPU's kernels would be compared with a CPU's and an fp32 gate would measure the
    devices' difference against a CPU's noise floor, not the strategy's."""
    backend = pick_backend(nproc, launch_backend(LabConfig(device=device)))   # as the run's
    if backend == "staged":
        return torch.device(os.environ[SHARED_DEVICE]).type
    return "cuda" if backend == "nccl" else "cpu"


def reference_config(cfg: TrainConfig) -> TrainConfig:
    """`single` on the same model, data, steps and micro-batching as `cfg`, on the device its
    ranks use, without any fault (refimpl.lab.faults)."""
    return lab_config(cfg).with_(strategy="single", nproc=1, return_state=True, profile=False,
                     trace_dir=None, options={}, tp=1, pp=1, cp=1, ep=1, replicas=1,
                     sequence_parallel=False, schedule=None, virtual_stages=1, fault=None,
                     device=ranks_device(cfg.nproc, cfg.device),
                     # a resumed run equals the uninterrupted one: single from step 0
                     checkpoint_every=0, checkpoint_dir=None)


def reference_run(cfg: TrainConfig) -> dict:
    """`single` for `cfg` (reference_config), cached per configuration."""
    ref_cfg = reference_config(cfg)
    key = repr(ref_cfg)
    if key not in _reference_cache:
        _reference_cache[key] = train_on_ranks(ref_cfg)
        while len(_reference_cache) > REFERENCE_CACHE_SIZE:
            _reference_cache.popitem(last=False)
    _reference_cache.move_to_end(key)
    return _reference_cache[key]


def compare_with_single(cfg: TrainConfig, result: dict | None = None) -> Equivalence:
    """Run `cfg` (unless its result is given) and `single`; compare losses and final weights."""
    if result is None:
        result = train_on_ranks(lab_config(cfg).with_(return_state=True))
    ref = reference_run(cfg)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref["losses"]))
    weight_err, worst_tensor, exact = compare_states(result["state_dict"], ref["state_dict"])
    return Equivalence(cfg.strategy, cfg.nproc, loss_err, weight_err, worst_tensor,
                       exact and result["losses"] == ref["losses"], result["losses"], ref["losses"],
                       weight_tolerance(cfg), loss_tolerance(cfg))
