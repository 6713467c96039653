"""The collectives one rank calls in one step of a MoE model on dp x ep x pp, from the layout alone.

Notebook 09 traces such a run and counts the labelled calls of rank 0 per step
(refimpl.plan.composition.collectives_per_step); this is the arithmetic they must equal, one row per
(axis, op), so a trace that called one more all-to-all or one fewer send fails the comparison:

  ep   per MoE layer of the stage and per micro-batch: one all-gather of the routing counts over the
       token-holding ranks (refimpl.model.moe), and five all-to-alls (refimpl.parallel.ep.dispatch:
       the kept counts, the dispatch and the combine in forward; the combine's and the dispatch's
       backward);
  pp   per micro-batch, one activation sent forward unless the stage is the last and one gradient
       sent back unless it is the first, each met by a posted receive and its wait
       (refimpl.parallel.pp.runner); and once a step, the all-reduce that sums the stages' parts of
       the loss (every stage adds its MoE layers' aux loss: refimpl.step.global_mean_loss);
  dp   `ep`'s gradient sync: one all-reduce per replicated tensor of the stage over dp x cp, one per
       expert tensor over edp when edp > 1 (refimpl.parallel.ep.strategy), and the loss's mean.

Only the plain pipeline placement (one chunk per rank), and no tp or cp: their terms (tp's
activation all-reduces, ring attention's K/V sends, cp's sequence-piece counts) are to be added
with them.
"""
from __future__ import annotations

import pandas as pd

from refimpl.config import TrainConfig
from refimpl.model import build_model
from refimpl.parallel.pp.schedules import pipeline_schedule, placement
from refimpl.parallel.pp.stage import partition


def stage_tensors(cfg: TrainConfig, stage: int) -> tuple[int, int, int]:
    """(MoE layers, replicated parameter tensors, expert tensors per ep rank) of pipeline `stage`."""
    p = cfg.pp
    blocks = partition(cfg.model.n_layers, p)[stage] if p > 1 else range(cfg.model.n_layers)
    mine = {f"blocks.{i}." for i in blocks}
    heads = (("embed.",) if stage == 0 else ()) + (("final_norm.", "lm_head.") if stage == p - 1 else ())
    names = [n for n, _ in build_model(cfg.model, seed=0).named_parameters()
             if n.startswith(heads) or any(n.startswith(b) for b in mine)]
    experts = sum(".experts." in n for n in names)
    return len(blocks), len(names) - experts, experts // cfg.dims.ep


def expected_calls(cfg: TrainConfig, stage: int = 0) -> pd.DataFrame:
    """(axis, op, calls): what a rank of pipeline `stage` calls in one step of `cfg` (strategy ep)."""
    if cfg.tp > 1 or cfg.cp > 1 or (cfg.pp > 1 and (placement(pipeline_schedule(cfg)) != "loop"
                                                    or cfg.virtual_stages > 1)):
        raise ValueError("expected_calls counts dp x ep x pp with one chunk per rank; tp's and cp's "
                         "terms are not in it yet")
    dims, m, p = cfg.dims, cfg.micro_batches, cfg.pp
    layers, replicated, experts = stage_tensors(cfg, stage)
    dp_cp, edp = dims.dp * dims.cp, dims.size("edp")
    sends = m * ((stage < p - 1) + (stage > 0)) if p > 1 else 0
    rows = [("ep", "all_gather", layers * m if dp_cp > 1 else 0),
            ("ep", "all_to_all", 5 * layers * m if dims.ep > 1 else 0),
            ("pp", "isend", sends), ("pp", "irecv", sends), ("pp", "recv-wait", sends),
            ("pp", "all_reduce", 1 if p > 1 else 0),
            ("dp", "all_reduce", (replicated + 1 if dp_cp > 1 else 0) + (experts if edp > 1 else 0))]
    return pd.DataFrame(rows, columns=["axis", "op", "calls"]).query("calls > 0").reset_index(drop=True)


def calls_by_op(expected: pd.DataFrame) -> dict[str, int]:
    """Calls per op, summed over the axes (what a trace, which does not know the axis, counts)."""
    return expected.groupby("op").calls.sum().to_dict()
