"""One profiled schedule beside its predictions: the row notebook 07 §8 tabulates per schedule.

For a schedule run on `world` ranks with m micro-batches and profiled (refimpl.lab.measure.pp_measure:
`profile_pipeline`, then `action_slots` of its trace), the bubble four ways, from the most
idealised to the run itself:

  formula                          the closed form with equal costs (schedules.bubble_fraction)
  replay (units)                   the table replayed with F = B = W per chunk (simulate)
  replay (measured F/B/W)          the table replayed with this run's per-rank mean action times
  replay (+ action, receive, ...)  and with what an action, a collected message and a waited-for
                                   message cost outside the compute (measure.measured_costs)
  replay (each action's time ...)  every profiled step replayed with its own action times, median
  measured                         1 - busy / (ranks x span) of the trace

and beside them the point-to-point messages the table sends per step, and per stage the measured
activation peak against (chunks in flight from the table) x (bytes one chunk's forward saves).

And for stages that are not equal (the embedding on the first, the LM head on the last), each
stage's forward FLOPs counted by PyTorch against the formula (`stage_forward_flops`).
"""
from __future__ import annotations

import pandas as pd
import torch

from refimpl.lab.measure import pp_measure as measure
from refimpl.lab.pipeline.simulate import messages, simulated_bubble
from refimpl.model import GPTConfig, build_model, synthetic_batch
from refimpl.parallel.pp.schedules import bubble_fraction, placement, schedule_table
from refimpl.parallel.pp.stage import build_chunks, partition


def schedule_row(schedule: str, virtual_stages: int, ranks: list[dict], slots, world: int,
                 micro_batches: int) -> dict:
    """`ranks`: each rank's result of profile_pipeline (activation_peak, per_micro_batch);
    `slots`: measure.action_slots of the run's trace."""
    s, v, m = schedule, virtual_stages, micro_batches
    table = schedule_table(world, m, s, v)
    costs = measure.measured_costs(slots, world, m, s, v)
    sent, _ = messages(table, placement(s))
    row = {"schedule": s, "formula": bubble_fraction(world, m, s, v),
           "replay (units)": simulated_bubble(world, m, s, v),
           "replay (measured F/B/W)": measure.simulated_bubble_from(slots, world, m, s, v),
           "replay (+ action, receive, message cost)": measure.simulated_bubble_from(slots, world, m, s, v,
                                                                                     costs=costs),
           "replay (each action's time + cost)": pd.DataFrame(
               measure.replayed_steps(slots, world, m, s, v, costs)).replayed.median(),
           "measured": measure.measured_bubble(slots), "action cost ms": costs["action_cost"],
           "receive cost ms": costs["recv_cost"], "message cost ms": costs["comm"],
           "p2p messages / step": sum(map(len, sent.values()))}
    for r in ranks:
        row[f"act MiB stage {r['rank']}"] = r["activation_peak"] / 2**20
        row[f"predicted MiB stage {r['rank']}"] = measure.predicted_activation_peak(
            table[r["rank"]], r["per_micro_batch"]) / 2**20
    return row


# --- stages that are not equal (seed §3.4: 스테이지가 불균형하면 병목이 발생합니다) ------------------------

def stage_forward_flops(cfg: GPTConfig, stages: int, batch: int, seed: int = 0) -> list[int]:
    """Per stage, the FLOPs of one forward of a `batch` x cfg.seq_len micro-batch, counted by
    PyTorch's FlopCounterMode on the stage's own chunk (refimpl.parallel.pp.stage.build_chunks: the
    embedding on the first, final norm and LM head on the last), in one process."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(cfg, seed)
    x = synthetic_batch(cfg, batch, cfg.seq_len, seed, 0).micro_batches(1)[0].inputs
    counted = []
    with torch.no_grad():
        for stage in range(stages):
            chunk, = build_chunks(model, stages, stage)
            with FlopCounterMode(display=False) as counter:
                x = chunk(x)
            counted.append(counter.get_total_flops())
    return counted


def stage_forward_flops_formula(cfg: GPTConfig, stages: int, batch: int) -> list[int]:
    """The same from the shapes: per block and token 2·(4h² + 2·h·(r·h)) for the matmuls plus
    4·s·h for the scores and S·V (Narayanan et al. 2021, §5.1, forward only), per block range of
    `partition`; the last stage adds the LM head's 2·h·V per token. The embedding is a lookup."""
    h, s, r, v = cfg.d_model, cfg.seq_len, cfg.mlp_ratio, cfg.vocab_size
    tokens = batch * s
    per_block = tokens * (2 * (4 * h * h + 2 * h * r * h) + 4 * s * h)
    out = [len(blocks) * per_block for blocks in partition(cfg.n_layers, stages)]
    out[-1] += tokens * 2 * h * v
    return out
