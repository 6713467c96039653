"""What a rank of a CPU layout keeps between steps, counted to the byte from the reference model's
own tensors: the prediction that the loop's measured model states (refimpl.train: the bytes of
the parameter, gradient and optimizer tensors a rank holds) must equal exactly.

The planner (refimpl.lab.plan.memory) predicts from a ModelShape, which describes Megatron's block
and not refimpl's tiny GPT to the byte: it counts a K bias (refimpl's attention has none: a bias
on K adds the same number to every score of a query, which the softmax cancels), a position table
of the run's s rows (the GPT holds cfg.seq_len rows, the longest sequence it accepts) and no final
LayerNorm. Here each parameter tensor of GPT(cfg) is placed instead:

  * pipeline: the blocks of each stage (refimpl.parallel.pp.stage.partition), the embedding on the
    first stage, the final LayerNorm and the head on the last (seed 000 §3.4);
  * tensor parallel (Shoeybi et al. 2019 §3): Q, K, V and the MLP's up-projection column-parallel
    (weight and bias split t ways), W_O and the down-projection row-parallel (weight split, bias
    whole), the token table and the head vocabulary-parallel; LayerNorms and positions whole;
  * ZeRO over dp x cp (Rajbhandari et al. 2020 §5): refimpl.memory.model_state_bytes, padded, in
    fp32 with AdamW's m and v (4 + 4 + 8 bytes a parameter).
"""
from __future__ import annotations

from refimpl.lab.plan.layout import Layout
from refimpl.memory import model_state_bytes
from refimpl.mesh import ParallelDims
from refimpl.model import GPT, GPTConfig
from refimpl.parallel.pp.stage import partition

COLUMN_PARALLEL = ("attn.q.", "attn.k.", "attn.v.", "mlp.up.")   # weight and bias split
ROW_PARALLEL_WEIGHTS = ("attn.o.weight", "mlp.down.weight")       # bias kept whole
VOCAB_PARALLEL = ("embed.tok.", "lm_head.")


def tp_share(name: str, numel: int, tp: int) -> int:
    """Elements of parameter `name` on one tensor-parallel rank."""
    split = (any(p in name for p in COLUMN_PARALLEL) or name.endswith(ROW_PARALLEL_WEIGHTS)
             or name.startswith(VOCAB_PARALLEL))
    if split and numel % tp:
        raise ValueError(f"{name} ({numel} elements) does not split over tp = {tp}")
    return numel // tp if split else numel


def stage_parameter_counts(cfg: GPTConfig, pp: int, tp: int) -> list[int]:
    """Parameters one tensor-parallel rank of each pipeline stage holds, first stage first."""
    model, counts = GPT(cfg), []
    for stage, blocks in enumerate(partition(cfg.n_layers, pp)):
        own = tuple(f"blocks.{i}." for i in blocks)
        if stage == 0:
            own += ("embed.",)
        if stage == pp - 1:
            own += ("final_norm.", "lm_head.")
        counts.append(sum(tp_share(name, p.numel(), tp)
                          for name, p in model.named_parameters() if name.startswith(own)))
    return counts


def kept_state_bytes(cfg: GPTConfig, lay: Layout) -> list[int]:
    """Model-state bytes (params + grads + AdamW's m and v, fp32) of a rank of each pipeline stage."""
    return [int(model_state_bytes(n, dp=lay.dp * lay.cp, zero_stage=lay.zero_stage, param_bytes=4,
                                  grad_bytes=4, optimizer_bytes=8).total)
            for n in stage_parameter_counts(cfg, lay.pp, lay.tp)]


def kept_state_bytes_by_rank(cfg: GPTConfig, lay: Layout) -> list[int]:
    """kept_state_bytes for every rank of the grid (refimpl.mesh), rank order."""
    per_stage = kept_state_bytes(cfg, lay)
    dims = ParallelDims(dp=lay.dp, pp=lay.pp, cp=lay.cp, tp=lay.tp)
    return [per_stage[dims.coordinates(rank)["pp"]] for rank in range(dims.world_size)]
