"""The MoE layer's layout constraints, checked in the launching process (one line each).

`validate_moe`: the layer's own knobs and ep's divisibility. `batch_scope_problem`: where the
default capacity scope (refimpl.model.moe's docstring, "Scope") cannot equal single, a fact about
that rule, not about the code: it counts a forward's tokens in batch order, and some layouts give a
forward other tokens, or the same ones in another order.
"""
from __future__ import annotations

from refimpl.mesh import LayoutError
from refimpl.model.config import GPTConfig

BALANCE = ("aux", "bias", "none")
SCOPES = ("batch", "sequence")       # capacity_scope: what C and the aux loss's f_i count over


def validate_moe(cfg: GPTConfig, ep: int = 1) -> None:
    """The MoE layout constraints, in the launching process; raises LayoutError (one line)."""
    if cfg.n_experts == 0:
        if ep > 1:
            raise LayoutError(f"expert parallelism (ep = {ep}) needs --experts E > 0")
        return
    if cfg.n_experts < 0:
        raise LayoutError(f"--experts must be >= 0 (got {cfg.n_experts})")
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise LayoutError(f"--top-k must be in [1, --experts = {cfg.n_experts}] (got {cfg.top_k})")
    if not cfg.capacity_factor > 0:
        raise LayoutError(f"--capacity-factor must be > 0 (got {cfg.capacity_factor})")
    if cfg.balance not in BALANCE:
        raise LayoutError(f"--set balance must be one of {', '.join(BALANCE)} (got {cfg.balance!r})")
    if cfg.capacity_scope not in SCOPES:
        raise LayoutError(f"--set capacity_scope must be one of {', '.join(SCOPES)} "
                          f"(got {cfg.capacity_scope!r})")
    for key in ("aux_alpha", "bias_gamma"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise LayoutError(f"--set {key} must be a number >= 0 (got {value!r})")
    if cfg.n_experts % ep:
        raise LayoutError(f"--experts {cfg.n_experts} must be divisible by ep = {ep}: "
                          f"every rank of the ep group holds E/ep experts")


def batch_scope_problem(cfg: GPTConfig, *, dp: int, cp: int, micro_batches: int) -> str | None:
    """Why capacity_scope=batch would differ from single in this layout (None: it does not)."""
    if cfg.n_experts == 0 or cfg.capacity_scope != "batch":
        return None
    regrouped = dp > 1 and micro_batches > 1
    if not (regrouped or cp > 1):
        return None
    why = ("a forward holds the i-th micro-batch of every data-parallel rank's rows, not single's "
           "i-th micro-batch" if regrouped else
           "a cp rank's tokens are two chunks of each sequence, not a run of the batch")
    if regrouped and cfg.balance == "aux":
        return (f"--set capacity_scope=batch with balance=aux: f_i counts one forward's tokens and {why}; "
                "use --set capacity_scope=sequence")
    if cfg.top_k * cfg.capacity_factor < cfg.n_experts:
        return (f"--set capacity_scope=batch fills experts in a forward's batch order and {why}: needs "
                f"--capacity-factor >= E/k = {cfg.n_experts / cfg.top_k:g} (nothing overflows) "
                "or --set capacity_scope=sequence")
    return None
