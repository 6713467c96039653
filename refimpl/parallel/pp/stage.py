"""Cutting the GPT into pipeline stages (seed 000, sec. 3.4: 스테이지 / partition).

embedding -> blocks -> final_norm -> lm_head is cut into p*v pieces of whole blocks; rank r holds
the pieces schedules.piece_of names (round-robin: piece c*p + r as its chunk c). Each piece keeps
the reference's parameter names, so the full state dict is the union of every stage's.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn

from refimpl.mesh import LayoutError
from refimpl.model import GPT
from refimpl.parallel.pp.schedules import (
    chunks_per_rank,
    parse_entry,
    piece_of,
    pipeline_schedule,
    placement,
    rank_of,
    schedule_table,
)


def partition(n_blocks: int, pieces: int) -> list[range]:
    """Consecutive block ranges, as equal as whole blocks allow, the extra ones first (the last
    piece also carries the head and the loss): 4 blocks over 3 pieces -> 2, 1, 1."""
    if pieces > n_blocks:
        raise LayoutError(f"{pieces} pipeline pieces (stages x virtual stages) need at least as many "
                          f"transformer blocks; the model has {n_blocks}")
    base, extra = divmod(n_blocks, pieces)
    starts = [k * base + min(k, extra) for k in range(pieces + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


class StageChunk(nn.Module):
    """One piece of the model: [embedding] + some blocks + [final_norm, lm_head]."""

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool, seq_split: int = 1):
        super().__init__()
        if model.cfg.tie_embeddings and not (first and last):
            raise LayoutError("pipeline parallelism here needs untied embeddings (tie_embeddings=False)")
        self.d_model = model.cfg.d_model
        self.seq_split = seq_split      # under sequence parallelism s/t tokens travel between stages
        self.is_first, self.is_last = first, last
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.final_norm = model.final_norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.final_norm(x))
        return x


def build_chunks(model: GPT, stages: int, stage: int, virtual_stages: int = 1,
                 seq_split: int = 1, where: str = "loop") -> list[StageChunk]:
    """This rank's chunks, chunk c being piece piece_of(stage, c); the rest of `model` is dropped."""
    pieces = stages * virtual_stages
    ranges = partition(len(model.blocks), pieces)
    mine = [piece_of(stage, c, stages, where) for c in range(virtual_stages)]
    return [StageChunk(model, ranges[k], first=k == 0, last=k == pieces - 1, seq_split=seq_split)
            for k in mine]


class PipelineStageModel(nn.Module):
    """This rank's chunks as one module with the reference's parameter names, plus what the step
    needs: the chunks in order, the whole table (row `stage` is this rank's) and the pp group. The
    step runs it with runner.pipeline_forward_backward, never forward()."""

    def __init__(self, chunks: list[StageChunk], table: list[list[str]], stage: int, group,
                 schedule: str, loss_stage: int):
        super().__init__()
        self.embed = next((c.embed for c in chunks if c.embed is not None), None)
        self.blocks = nn.ModuleDict({k: b for c in chunks for k, b in c.blocks.items()})
        last = next((c for c in chunks if c.is_last), None)
        self.final_norm = last.final_norm if last else None
        self.lm_head = last.lm_head if last else None
        self.chunks = list(chunks)       # a plain list: the modules are registered once, above
        self.table, self.actions = table, table[stage]
        self.group, self.schedule, self.where = group, schedule, placement(schedule)
        self.loss_stage = loss_stage      # the stage holding the last piece

    def gradient_accumulations(self) -> dict[str, int]:
        """Parameter name -> how often one step accumulates its gradient (its chunk's B's, or W's
        under a split table): what the bucketed dp counts down to know a gradient is final."""
        actions = [a for entry in self.actions for a in parse_entry(entry)]
        kind = "W" if any(a.kind == "W" for a in actions) else "B"
        per_chunk = Counter(a.chunk for a in actions if a.kind == kind)
        return {name: per_chunk[c] for c, chunk in enumerate(self.chunks)
                for name, _ in chunk.named_parameters()}


def split_for_pipeline(model: GPT, ctx, seq_split: int = 1) -> PipelineStageModel:
    """The pipeline transform: this rank's stage of `model` on the mesh's pp axis."""
    cfg, mesh = ctx.cfg, ctx.mesh
    p, stage = mesh.size("pp"), mesh.index("pp")
    schedule = pipeline_schedule(cfg)
    v, where = chunks_per_rank(schedule, cfg.virtual_stages), placement(schedule)
    chunks = build_chunks(model, p, stage, v, seq_split, where)
    table = schedule_table(p, cfg.micro_batches, schedule, v)
    return PipelineStageModel(chunks, table, stage, mesh.group("pp"), schedule,
                              loss_stage=rank_of(p * v - 1, p, where))
