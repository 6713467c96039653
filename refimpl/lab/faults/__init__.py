"""Bugs on purpose: eight faults that real implementations shipped, to learn the tools on.

`--set fault=<name>` (LabConfig.fault) injects one. The mechanisms have no fault branch: each fault
is a class of this folder (strategies.py) that a run with that fault uses in its strategy's place:
a strategy whose sync differs, a mutated loss or transform, pipeline links that receive out of
order, a step that loses its rank. `variant`, a plug-in of refimpl.registry (the entry-point group
"refimpl.variants", pyproject.toml), picks it. Notebook 10 runs each, shows the symptom a user
would see, and asserts that the bisector (refimpl.lab.verify.bisect), the hang report
(refimpl.lab.runtime.flight_recorder) or the launcher's rank-and-traceback finds it.

They run only where REFIMPL_FAULTS=1 (the tests and notebook 10 set it): a fault in a training
run is a mistake, so the layout check refuses it elsewhere, before any rank starts.
"""
from __future__ import annotations

import os

from refimpl.lab.config import lab_config
from refimpl.lab.faults.lost_rank import lose_this_rank
from refimpl.lab.faults.strategies import faulty_class
from refimpl.mesh import LayoutError
from refimpl.strategy import Strategy

__all__ = ["ENV", "FAULTS", "check", "lose_this_rank", "variant"]

ENV = "REFIMPL_FAULTS"

# name -> (what it does, the real bug of its kind, the layout it needs)
FAULTS = {
    "skip-grad-sync": ("dp-naive leaves the last block's gradients out of the dp all-reduce",
                       "a gradient sync missed on one axis (picotron's DP x 1F1B, its PR #5)"),
    "vocab-unmasked": ("tp's cross-entropy does not mask the padded vocabulary rows",
                       "a vocabulary that does not divide by tp (Megatron-LM #1754)"),
    "pp-loss-scaled-twice": ("the pipeline backpropagates loss / m / m; the loss it reports is right",
                             "gradients scaled by the micro-batch count once too often: torchtitan "
                             "#1733 (PP's scale_grads under gradient accumulation; fix PR #1732)"),
    "p2p-misordered": ("stage 0's first backward waits for the last micro-batch's gradient",
                       "a send/recv pair posted in mismatched order: a hang (PyTorch #118369)"),
    "rank-dies": ("rank 1 loses its links at the start of step 1, then, once its peers have "
                  "failed, is killed (SIGKILL)",
                  "a lost node: its peers fail on a closed connection before it is gone"),
    "zero1-unsynced": ("zero1 steps each rank's shard with that rank's own, unreduced gradients",
                       "an optimizer shard stepped before its gradients were reduced"),
    "sp-norm-unsummed": ("under sequence parallelism the LayerNorms' weight gradients are not summed "
                         "over tp: each tp rank steps them with its own tokens' part",
                         "SP's LayerNorm gradients left partial (Megatron-LM #1446: final_layernorm "
                         "gradients differ across tp ranks under TP + SP)"),
    "expert-grad-over-dp": ("an expert's gradient is all-reduced over dp with the other ranks' "
                            "(different) experts, instead of over the ranks holding the same expert",
                            "expert gradients reduced over the wrong group (DeepSpeed #5618: ZeRO "
                            "with expert parallelism, expert gradients ep times too large)"),
}


def check(cfg) -> None:
    """Raise LayoutError (one line) unless `cfg.fault` may run here, on this layout."""
    name = cfg.fault
    if name not in FAULTS:
        raise LayoutError(f"unknown fault {name!r}; choose one of: {', '.join(FAULTS)}")
    if os.environ.get(ENV) != "1":
        raise LayoutError(f"--set fault={name} injects a bug on purpose; it runs only where "
                          f"{ENV}=1 (the tests and notebook 10 set it)")
    needs = {
        "skip-grad-sync": (cfg.strategy == "dp-naive" and cfg.pp == 1 and cfg.nproc > cfg.tp * cfg.cp,
                           "--strategy dp-naive with dp > 1 and no --pp"),
        "vocab-unmasked": (cfg.tp > 1 and cfg.model.vocab_size % cfg.tp != 0,
                           "--tp > 1 and a vocabulary that does not divide by it"),
        "pp-loss-scaled-twice": (cfg.pp > 1 and cfg.micro_batches > 1, "--pp > 1 and --micro-batches > 1"),
        "p2p-misordered": (cfg.pp > 1 and cfg.micro_batches > cfg.pp and _one_f_one_b(cfg),
                           "--strategy pp-1f1b (or --schedule 1f1b) and --micro-batches > --pp"),
        "rank-dies": (cfg.nproc > 1 and cfg.steps > 1, "--nproc > 1 and --steps > 1"),
        "zero1-unsynced": (cfg.strategy == "zero1" and cfg.nproc > cfg.tp * cfg.cp * cfg.pp,
                           "--strategy zero1 with dp > 1"),
        "sp-norm-unsummed": (cfg.tp > 1 and cfg.sequence_parallel, "--tp > 1 and --sequence-parallel"),
        "expert-grad-over-dp": (cfg.model.n_experts > 0 and cfg.strategy in ("ep", "dp-naive")
                                and cfg.nproc > cfg.tp * cfg.cp * cfg.pp,
                                "a MoE model (n_experts > 0) under --strategy ep (or dp-naive with "
                                "--ep) with dp > 1"),
    }
    ok, layout = needs[name]
    if not ok:
        raise LayoutError(f"fault {name!r} needs {layout}")


def _one_f_one_b(cfg) -> bool:
    return cfg.schedule == "1f1b" or (cfg.schedule is None and cfg.strategy == "pp-1f1b")


def variant(cfg, strategy_class: type[Strategy]) -> type[Strategy]:
    """The plug-in: the class a run of `cfg` uses in `strategy_class`'s place -- itself without a
    fault, the fault's class after `check` (in the launching process: one line, before launch)."""
    cfg = lab_config(cfg)
    if cfg.fault is None:
        return strategy_class
    check(cfg)
    return faulty_class(cfg.fault, strategy_class)
