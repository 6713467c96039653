"""Where MoE's default capacity scope cannot equal single: capacity_scope=batch counts a forward's
tokens in batch order, and some layouts give a forward other tokens, or the same in another order.
The lab's loop (refimpl.lab.loop) refuses those layouts before launch, so every run equals single."""
from __future__ import annotations

from refimpl.model import GPTConfig


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
