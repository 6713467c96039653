"""The first test of every strategy: does it compute exactly what `single` computes?

Same seed, same global batch, same number of steps: the losses and the final weights must match the
one-process reference (fp32: relative error <= 1e-5; bit-exact where the arithmetic is identical).
The reference runs on the device the ranks use (`ranks_device`): CPU when they are on gloo, the
GPU when they are on NCCL; on CUDA with TF32 off and deterministic kernels (refimpl.numerics), so
the same 1e-5 holds there (TF32's 10-bit mantissa would put it near 1e-3).
`compare_with_single` runs both and reports the worst relative errors, so a notebook can assert
them and a test can assert them on world sizes 2, 4 and one that does not divide evenly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from refimpl.strategy import TrainConfig
from refimpl.train import resolve_layout, train_on_ranks

TOLERANCE = 1e-5
# Tensor parallelism's weights after 3 AdamW steps, ours and PyTorch's alike: see weight_tolerance.
TP_WEIGHT_TOLERANCE = 5e-5


def weight_tolerance(cfg: TrainConfig) -> float:
    """TOLERANCE, except for PyTorch's twins on world sizes that are not powers of two, and for
    tensor parallelism.

    DDP and FSDP2 divide every reduced gradient element by the world size; 1/3 is not exact in
    binary, so each element carries one more rounding than `single`'s, which AdamW amplifies to
    ~1.1e-5 after 3 steps. Our strategies scale the loss by 1/W before backward and sum instead,
    and stay at ~5e-6 on the same runs. The twins are compared as PyTorch ships them.

    Tensor parallelism (tp > 1) changes the order of the sums inside the matmuls themselves (a
    row-parallel layer adds t partial products; every input gradient of a column-parallel one
    too), so its gradients differ from single's by ~1e-6 relative, element by element. AdamW's
    first steps move an element by lr·g/(|g| + eps): where a gradient element is ~eps = 1e-8, a
    1e-9 difference is a visible change of step, and the weights land 1.5-2e-5 apart (measured,
    for `tp` and for PyTorch's `torch-tp` alike) while the losses stay within 1e-7. The maths is
    single's: in float64 the same comparison is within 1e-13 (tests/test_tp.py,
    refimpl.parallel.tp_checks.model_checks).

    Context parallelism (cp > 1) reorders attention's softmax sums (ring attention's online
    softmax): the same amplification, measured at ~1.5e-5 in one process by swapping in an
    identical attention (tests/test_cp.py, reformulation_floor), exact in float64 there too.
    """
    layout = resolve_layout(cfg)
    if layout.tp > 1 or layout.cp > 1:
        return TP_WEIGHT_TOLERANCE
    twin = cfg.strategy.startswith("torch-")
    power_of_two = cfg.nproc & (cfg.nproc - 1) == 0
    return TOLERANCE if power_of_two or not twin else 2 * TOLERANCE


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

    tolerance: float = TOLERANCE

    @property
    def ok(self) -> bool:
        return self.loss_rel_err <= TOLERANCE and self.weight_rel_err <= self.tolerance


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


_reference_cache: dict = {}


def ranks_device(nproc: int) -> str:
    """The device type `nproc` ranks compute on ("cuda" under NCCL, one GPU per rank; else
    "cpu"): a reference for them must run there too, or a GPU's kernels would be compared with
    a CPU's and the differences would be the devices', not the strategy's."""
    from refimpl.launch import pick_backend

    return "cuda" if pick_backend(nproc) == "nccl" else "cpu"


def reference_run(cfg: TrainConfig) -> dict:
    """`single` on the same model, data, steps and micro-batching, on the device `cfg`'s ranks
    use; cached per configuration."""
    ref_cfg = cfg.with_(strategy="single", nproc=1, return_state=True, profile=False,
                        trace_dir=None, options={}, tp=1, pp=1, cp=1, ep=1, replicas=1,
                        sequence_parallel=False, schedule=None, virtual_stages=1,
                        device=ranks_device(cfg.nproc))
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
    weight_err, worst_tensor, exact = compare_states(result["state_dict"], ref["state_dict"])
    return Equivalence(cfg.strategy, cfg.nproc, loss_err, weight_err, worst_tensor,
                       exact and result["losses"] == ref["losses"], result["losses"], ref["losses"],
                       weight_tolerance(cfg))
