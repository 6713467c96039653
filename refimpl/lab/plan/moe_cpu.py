"""The planner's expert layouts checked against the loop: model-state bytes, predicted and counted.

    table = moe_states_table(LAYOUTS, cfg)      # one launch of 4 CPU ranks, one step per layout

Each layout runs one step of refimpl's own loop (refimpl.train) on a small MoE GPT; every rank
reports the parameters, gradients and optimizer states it holds (refimpl.lab.instrument.model_state: the
dense ones replicated or sharded over dp x cp, the experts over edp). The planner predicts the
same bytes from its arithmetic (refimpl.lab.plan.moe through predict_memory, precision "fp32": the
loop's fp32 weights and grads and AdamW's m and v). Arithmetic against arithmetic: they must agree
to within the flat buffers' padding (ZeRO/FSDP pad a shard to ceil(N/ranks)), well under 1 %.
"""
from __future__ import annotations

import pandas as pd

from refimpl.config import TrainConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.plan.cpu_calibration import shape_of
from refimpl.lab.plan.predict import Layout, predict_memory
from refimpl.model import GPTConfig

ZERO_STAGE = {"dp-naive": 0, "dp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
STATES = ("params", "grads", "optimizer")

# A MoE GPT whose 4 experts hold most of its parameters: 2 blocks, width 32, vocabulary 96.
MOE_MODEL = GPTConfig(vocab_size=96, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4,
                      top_k=2)

# (strategy, dp, tp, ep, pp) on 4 ranks: the experts over ep with each dp flavour that shards them
# over edp, edp = 1 (ep = dp x cp: nothing left to shard the experts over), and experts split over
# tp (zero2 with dp 2, tp 2, ep 2), and a pipeline (zero1 on dp 2 x pp 2, ep 2; the planner's row
# is the first stage, the largest here: its word and position embeddings outweigh the head).
LAYOUTS = (("zero1", 4, 1, 2, 1), ("zero3", 4, 1, 4, 1), ("fsdp", 4, 1, 2, 1),
           ("zero2", 2, 2, 2, 1), ("zero1", 2, 1, 2, 2))


def layout_config(strategy: str, dp: int, tp: int, ep: int, pp: int, cfg: GPTConfig,
                  global_batch: int) -> TrainConfig:
    return TrainConfig(strategy=strategy, nproc=dp * tp * pp, tp=tp, pp=pp, ep=ep,
                       global_batch=global_batch, seq_len=cfg.seq_len, steps=1, model=cfg,
                       device="cpu")


def moe_states_table(layouts=LAYOUTS, cfg: GPTConfig = MOE_MODEL,
                     global_batch: int = 8) -> pd.DataFrame:
    """Predicted and measured model-state bytes per category, one row per layout (the largest
    rank's measurement: ranks differ only by padding). All layouts in one launch."""
    configs = [layout_config(*row, cfg, global_batch) for row in layouts]
    results = train_several_on_ranks(configs)
    shape = shape_of(cfg, cfg.seq_len)
    rows = []
    for (strategy, dp, tp, ep, pp), result in zip(layouts, results):
        lay = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero_stage=ZERO_STAGE[strategy],
                     micro_batch_size=global_batch // dp)
        predicted = predict_memory(shape, lay, global_batch, precision="fp32",
                                   activations="refimpl")
        row = {"strategy": strategy, "dp": dp, "tp": tp, "pp": pp, "ep": ep, "edp": dp // ep}
        for category in STATES:
            measured = max(rank[category] for rank in result["memory"])
            row[f"{category}_measured"] = measured
            row[f"{category}_planned"] = predicted[f"{category}_bytes"]
            row[f"{category}_err"] = predicted[f"{category}_bytes"] / measured - 1
        rows.append(row)
    return pd.DataFrame(rows)
