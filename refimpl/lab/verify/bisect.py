"""Where does a layout first part from `single`? A divergence bisector.

    report = bisect(TrainConfig(strategy="dp-naive", nproc=2, steps=2))
    print(report.summary())        # "no divergence ..." or "bug: step 0, optimizer, blocks.1 ..."

`compare_with_single` (refimpl.lab.verify.equivalence) says whether a layout equals the reference;
this says where it stops doing so. Both runs (the layout on its ranks, `single` in this process)
use the same seed and batches and record, per step:

    forward    each module's output (embedding, every block, the final norm) as a fingerprint:
               the sum and the sum of squares over all tokens of the global batch, per feature
    loss       the step's loss
    backward   the gradient reaching each module's output, fingerprinted the same way
    optimizer  every parameter after the step (the strategy's full state dict)

A fingerprint adds up: a rank sums over its own tokens, and the launcher adds the ranks that hold
distinct tokens (dp, cp; tp too under sequence parallelism, where each tp rank holds s/t of
them; without it tp ranks hold the same full activations and one of them counts). So no layout
needs its activations gathered, and a pipeline's stages each report the modules they hold.
The first record, in that order, whose relative error passes the tolerance is the divergence.

Noise or bug: in float32 a reordered sum differs by ~1e-7 per operation and tensor or context
parallelism reorder many (their weights drift ~1e-5 from single's). So a float32 divergence is
rerun in float64: reduction-order noise vanishes there (< 1e-9), a bug does not, and the report
says which it found. Fingerprints are kept per micro-batch (every schedule runs a module's
micro-batches in order) and compared per micro-batch where no rank splits the batch's rows
(dp = 1: tp, pp, cp); with dp > 1 a rank's micro-batch k holds other rows than the reference's
micro-batch k, so they are summed over the step.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field

import torch

from refimpl.config import TrainConfig
from refimpl.lab.checkpoint.full_state import full_state_dict
from refimpl.lab.loop import setup_rank
from refimpl.lab.verify.equivalence import FP64_TOLERANCE, reference_config
from refimpl.launch import run
from refimpl.mesh import LayoutError
from refimpl.model import synthetic_batch
from refimpl.registry import resolve
from refimpl.train import in_this_process, launch_backend, validate

FP32_TOLERANCE = 1e-6     # tight on purpose: what it flags is then sorted by the float64 rerun
_WATCHED = re.compile(r"(?:^|\.)(embed|blocks\.\d+|final_norm)$")
_MODULE = re.compile(r"^(embed|blocks\.\d+|final_norm|lm_head)\.")
PHASES = ("forward", "loss", "backward", "optimizer")


@dataclass
class Divergence:
    step: int
    phase: str          # forward, loss, backward, optimizer (the dp sync or the optimizer's step)
    module: str         # the reference's module name ("blocks.1"), or "loss"
    error: float        # relative error of the fingerprint, the loss, or the module's weights
    ranks: list[int]    # the ranks that hold the module
    micro_batch: int | None = None   # where dp = 1 (see the module docstring); else summed

    def line(self) -> str:
        where = "" if self.micro_batch is None else f", micro-batch {self.micro_batch}"
        return (f"step {self.step}{where}, {self.phase}, {self.module}: relative error "
                f"{self.error:.2e} (ranks {self.ranks})")


@dataclass
class Report:
    verdict: str                        # "no divergence", "bug" or "noise"
    first: Divergence | None            # the first divergence of the run as asked
    tolerance: float
    float64: Divergence | None = None   # the rerun's first divergence (None: it found none)
    float64_error: float = 0.0          # the rerun's largest error, where it found none
    not_compared: list[str] = field(default_factory=list)
    largest_error: float = 0.0          # the largest error of any record compared, as asked
    losses: list[float] = field(default_factory=list)              # the layout's, as asked
    reference_losses: list[float] = field(default_factory=list)    # single's

    def to_dict(self) -> dict:
        return asdict(self) | {"summary": self.summary()}

    def summary(self) -> str:
        if self.first is None:
            return (f"no divergence (largest relative error {self.largest_error:.1e}, "
                    f"tolerance {self.tolerance:.0e})")
        if self.verdict == "noise":
            return (f"noise: {self.first.line()}; in float64 every record agrees to "
                    f"{self.float64_error:.1e}, so it is reduction order, not a bug")
        return f"bug: {(self.float64 or self.first).line()}"


def bisect(cfg: TrainConfig, tolerance: float | None = None, timeout: float = 300.0) -> Report:
    """Run `cfg` and `single`, record both, name the first divergence (see the module docstring)."""
    if cfg.strategy.startswith("torch-"):
        raise ValueError("bisect follows refimpl's own strategies; PyTorch's twins keep DTensor or "
                         "wrapped modules whose outputs it does not fingerprint")
    tolerance = tolerance or (FP64_TOLERANCE if cfg.dtype == "float64" else FP32_TOLERANCE)
    (first, largest, missing), losses = _first_divergence(cfg, tolerance, timeout)
    seen = {"not_compared": missing, "losses": losses[0], "reference_losses": losses[1],
            "largest_error": largest}
    if first is None:
        return Report("no divergence", None, tolerance, **seen)
    if cfg.dtype == "float64":
        return Report("bug", first, tolerance, **seen)
    (again, largest64, _), _ = _first_divergence(cfg.with_(dtype="float64"), FP64_TOLERANCE,
                                                 timeout)
    return Report("bug" if again else "noise", first, tolerance, again, largest64, **seen)


def main(make_config, as_json: bool = False, timeout: float = 300.0) -> int:
    """`python -m refimpl bisect <train flags> [--json]`: print the report; exit 1 on a bug, 2 on
    a layout that cannot run (one line, as train says it)."""
    try:
        cfg = make_config()
        validate(cfg)
        report = bisect(cfg, timeout=timeout)
    except (LayoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict()) if as_json else report.summary())
    return 1 if report.verdict == "bug" else 0


def _first_divergence(cfg, tolerance, timeout):
    cfg = validate(cfg).cfg     # a shorthand's axes filled in (refimpl.registry)
    per_rank = (run(record_rank, cfg.nproc, cfg, timeout=timeout, quiet=True,
                    backend=launch_backend(cfg)) if cfg.nproc > 1 else
                [in_this_process(record_rank, 0, 1, cfg)])
    ref_cfg = reference_config(cfg)
    ref = in_this_process(record_rank, 0, 1, ref_cfg)
    losses = ([s["loss"] for s in per_rank[0]["steps"]], [s["loss"] for s in ref["steps"]])
    # Micro-batch k holds the reference's rows of micro-batch k only where no rank splits rows.
    per_micro_batch = cfg.dims.dp == 1 and cfg.replicas == 1
    return compare(per_rank, ref, cfg.sequence_parallel, tolerance, per_micro_batch), losses


def record_rank(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    """Train `cfg` on this rank, recording every step's fingerprints, loss and weights."""
    ctx, strategy, _ = setup_rank(rank, world_size, resolve(cfg))
    forward: dict[str, torch.Tensor] = {}
    backward: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(_hook(canonical[1], forward, backward))
               for name, m in strategy.rank_model.module.named_modules()
               if (canonical := _WATCHED.search(name))]
    steps = []
    for step in range(cfg.steps):
        forward.clear(), backward.clear()
        batch = synthetic_batch(cfg.model, cfg.global_batch, cfg.seq_len, cfg.seed, step)
        loss = strategy.train_step(batch)
        weights = full_state_dict(strategy)          # collective: every rank calls it
        steps.append({"loss": float(loss),       # fingerprints: [calls (micro-batches), 2, d]
                      "forward": {k: torch.stack(v).cpu() for k, v in forward.items()},
                      "backward": {k: torch.stack(v).cpu() for k, v in backward.items()},
                      "weights": weights if rank == 0 else None})
    for h in handles:
        h.remove()
    return {"rank": rank, "coords": dict(ctx.mesh.coords), "steps": steps}


def _hook(name: str, forward: dict, backward: dict):
    def record(module, inputs, out):
        if not isinstance(out, torch.Tensor):
            return
        _add(forward, name, out)
        if out.requires_grad:
            out.register_hook(lambda grad: _add(backward, name, grad))
    return record


def _add(into: dict, name: str, t: torch.Tensor) -> None:
    """Sum and sum of squares over every token, per feature (float64, on the rank's device), one
    entry per call: every schedule runs a module's micro-batches in order, forward and backward."""
    x = t.detach().to(torch.float64).reshape(-1, t.shape[-1])
    into.setdefault(name, []).append(torch.stack([x.sum(0), (x * x).sum(0)]))


def compare(per_rank: list[dict], ref: dict, sequence_parallel: bool, tolerance: float,
            per_micro_batch: bool = False):
    """(first Divergence or None, the largest error seen, the modules found on one side only)."""
    counted = [r for r in per_rank
               if r["coords"].get("replica", 0) == 0 and (sequence_parallel or r["coords"]["tp"] == 0)]
    largest, missing = 0.0, set()
    for step, ref_step in enumerate(ref["steps"]):
        holders = _holders(per_rank, step)
        for phase in PHASES:
            for module, mb, error in _errors(phase, step, counted, per_rank, ref_step, missing,
                                             per_micro_batch):
                largest = max(largest, error)
                if not error <= tolerance:            # NaN counts as a divergence
                    return (Divergence(step, phase, module, error, holders.get(module, []), mb),
                            largest, sorted(missing))
    return None, largest, sorted(missing)


def _errors(phase, step, counted, per_rank, ref_step, missing, per_micro_batch):
    """(module, micro-batch or None, relative error) in the order the step runs them."""
    if phase == "loss":
        yield "loss", None, _rel(torch.tensor(per_rank[0]["steps"][step]["loss"]),
                           torch.tensor(ref_step["loss"]))
        return
    if phase == "optimizer":
        ours, theirs = per_rank[0]["steps"][step]["weights"], ref_step["weights"]
        for module in _model_order({_MODULE.match(n)[1] for n in theirs if _MODULE.match(n)}):
            names = [n for n in theirs if n.startswith(module + ".")]
            missing.update(n for n in names if n not in ours)
            names = [n for n in names if n in ours]
            yield module, None, _rel(torch.cat([ours[n].double().flatten() for n in names]),
                               torch.cat([theirs[n].double().flatten() for n in names]))
        return
    summed: dict[str, torch.Tensor] = {}
    for r in counted:
        for module, fp in r["steps"][step][phase].items():
            summed[module] = summed[module] + fp if module in summed else fp
    missing.update(set(ref_step[phase]) ^ set(summed))
    order = _model_order(set(ref_step[phase]) & set(summed))
    for module in (order if phase == "forward" else reversed(order)):
        ours, theirs = summed[module], ref_step[phase][module]
        if not per_micro_batch or ours.shape != theirs.shape:
            yield module, None, _rel(ours.sum(0), theirs.sum(0))
            continue
        for mb in range(theirs.shape[0]):
            yield module, mb, _rel(ours[mb], theirs[mb])


def _holders(per_rank: list[dict], step: int) -> dict[str, list[int]]:
    held: dict[str, list[int]] = {}
    for r in per_rank:
        for module in r["steps"][step]["forward"]:
            held.setdefault(module, []).append(r["rank"])
    for module in ("lm_head", "loss"):      # on the last stage, with the final norm
        held[module] = held.get("final_norm", [])
    return held


def _model_order(modules: set[str]) -> list[str]:
    def key(m: str):
        if m == "embed":
            return (0, 0)
        if m.startswith("blocks."):
            return (1, int(m.split(".")[1]))
        return (2, 0 if m == "final_norm" else 1)
    return sorted(modules, key=key)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
