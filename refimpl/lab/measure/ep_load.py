"""What the router did during a run: tokens per expert, per rank, per step, and how uneven.

Seed (003): load balancing is the hard part of MoE -- a router that favours a few experts leaves
the devices holding the others idle. This module turns a run's per-step MoE records
(`result["per_rank"][r]["moe"]`, written by the loop from refimpl.lab.measure.moe_traffic.moe_step_record)
into tables a notebook plots and asserts on:

  expert_frame   one row per (step, layer, expert): assignments routed there, and kept
  rank_frame     one row per (step, layer, rank): rows that rank's experts processed -- what
                 decides how long its expert compute takes, so the step waits for the fullest rank
  imbalance      max / mean of a load (1.0 = perfectly even; E/k... = everything on one expert)

And `skew_router`, the controlled start of the balancing study: a router that already prefers
one expert (as a collapsed router does), so balance=none/aux/bias can be compared on how fast they
spread the load again.
"""
from __future__ import annotations

import pandas as pd
import torch

from refimpl.model.moe import MoEMLP


def expert_frame(result: dict) -> pd.DataFrame:
    """(step, layer, expert, routed, kept): the global load, the same on every rank."""
    rows = []
    for step, rec in enumerate(result["per_rank"][0]["moe"]):
        for layer, (routed, kept) in enumerate(zip(rec["routed"], rec["kept"])):
            for expert, (n, k) in enumerate(zip(routed, kept)):
                rows.append({"step": step, "layer": layer, "expert": expert, "routed": n, "kept": k})
    return pd.DataFrame(rows)


def rank_frame(result: dict) -> pd.DataFrame:
    """(step, layer, rank, expert, received): rows each rank's experts processed, per step."""
    rows = []
    for rank, per in enumerate(result["per_rank"]):
        for step, rec in enumerate(per["moe"]):
            for layer, received in enumerate(rec["received"]):
                per_expert = torch.tensor(received).sum(dim=0).tolist()   # over source ranks
                for j, n in enumerate(per_expert):
                    rows.append({"step": step, "layer": layer, "rank": rank,
                                 "expert": rec["first_expert"] + j, "received": n})
    return pd.DataFrame(rows)


def imbalance(load: pd.Series) -> float:
    """max / mean: how much longer the fullest expert (or rank) works than an even split."""
    return float(load.max() / load.mean())


def imbalance_by_step(df: pd.DataFrame, column: str, over: str) -> pd.DataFrame:
    """Per step, the imbalance of `column` across `over` (experts or ranks), averaged over layers."""
    per_layer = df.groupby(["step", "layer"])[column].apply(imbalance).rename("imbalance")
    return per_layer.groupby("step").mean().reset_index()


def dropped_by_step(result: dict) -> list[int]:
    """Assignments that overflowed an expert's capacity, per step (all layers)."""
    return [sum(rec["dropped"]) for rec in result["per_rank"][0]["moe"]]


@torch.no_grad()
def skew_router(model, strength: float = 3.0, seed: int = 1) -> None:
    """Make every MoE router prefer expert 0 (and, half as much, expert 1), in place.

    Every token entering the MoE layer gets a shared direction v (the pre-MLP LayerNorm's bias),
    and the router's rows for experts 0 and 1 get `strength` * v and `strength`/2 * v: the logit
    of expert 0 rises by about `strength` for every token, as after a router collapse.
    """
    g = torch.Generator().manual_seed(seed)
    for block in model.blocks:
        if not isinstance(block.mlp, MoEMLP):
            continue
        v = torch.randn(block.ln2.bias.shape[0], generator=g)
        v /= v.norm()
        block.ln2.bias.copy_(v)
        block.mlp.router.weight[0] += strength * v
        block.mlp.router.weight[1] += strength / 2 * v


def all_to_all_frame(result: dict, hidden: int, bytes_per_value: int = 4) -> pd.DataFrame:
    """(rank, step, sent_bytes, routed_bytes, padding_bytes): per step, what each rank's MoE
    all-to-alls put on the wire to other ranks (counted by the layer: the whole fixed-size
    buffers), how much of it is real rows, rebuilt from the routing records alone (each row that
    went to another rank's expert or came back from one, twice: forward, then backward), and the
    rest, padding.

    Assumes the `ep` strategy's grid (no tp/pp/cp): ep groups are chunks of consecutive ranks."""
    per_rank = result["per_rank"]
    rows = []
    for rank, per in enumerate(per_rank):
        for step, rec in enumerate(per["moe"]):
            ep = len(rec["received"][0])
            me, base = rank % ep, rank - rank % ep
            came = sum(sum(row) for layer in rec["received"] for s, row in enumerate(layer) if s != me)
            went = sum(sum(layer[me]) for p in range(ep) if p != me
                       for layer in per_rank[base + p]["moe"][step]["received"])
            sent = rec["all_to_all_bytes"]["sent"]
            routed = 2 * (came + went) * hidden * bytes_per_value
            rows.append({"rank": rank, "step": step, "sent_bytes": sent, "routed_bytes": routed,
                         "padding_bytes": sent - routed})
    return pd.DataFrame(rows)
