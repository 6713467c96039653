"""A rank's model is the reference model transformed in one fixed order: tensor, context and expert
parallelism, activation checkpointing, the pipeline's cut; data parallelism then places it."""
from __future__ import annotations

import functools

import torch.nn as nn

from refimpl.compose.tp_cp import apply_context_parallel_over_tp
from refimpl.model import lm_loss
from refimpl.model.activation_checkpointing import checkpoint_blocks
from refimpl.model.moe import moe_layers
from refimpl.parallel.cp.parallelize import apply_context_parallel, shard_batch
from refimpl.parallel.cp.ring import chunk_ids
from refimpl.parallel.ep.counts import ChunkedSequences
from refimpl.parallel.ep.dispatch import parallelize_experts, share_routing_counts
from refimpl.parallel.pp.runner import pipeline_forward_backward
from refimpl.parallel.pp.stage import split_for_pipeline
from refimpl.parallel.tp.parallelize import parallelize_tp, tp_loss_for
from refimpl.rank_model import Pipeline, RankModel


def model_parallel(model: nn.Module, ctx) -> RankModel:
    """This rank's share of the reference model (shapes only, or values), before data parallelism."""
    mesh, cfg = ctx.mesh, ctx.cfg
    loss_fn, seq_split = lm_loss, 1
    if mesh.size("tp") > 1:
        parallelize_tp(model, mesh.group("tp"), sequence_parallel=cfg.sequence_parallel)
        loss_fn = tp_loss_for(model.lm_head)      # reads the vocabulary-split logits
        seq_split = mesh.size("tp") if cfg.sequence_parallel else 1
    batch_chunks = None
    if mesh.size("cp") > 1:   # ring attention in every block, global positions
        if mesh.size("tp") > 1:   # each tp rank rings its own heads' K/V among its cp peers
            apply_context_parallel_over_tp(model, mesh.group("cp"), mesh.index("cp"),
                                           mesh.size("cp"))
        else:
            apply_context_parallel(model, mesh.group("cp"))
        batch_chunks = functools.partial(shard_batch, rank=mesh.index("cp"), cp=mesh.size("cp"))
        # MoE, capacity_scope=sequence: the layers learn which pieces of each sequence this rank
        # holds (ring attention's head-tail chunks), to count a sequence's capacity in order.
        pieces = [chunk_ids(r, mesh.size("cp")) for r in range(mesh.size("cp"))]
        for layer in moe_layers(model):
            layer.sequences = ChunkedSequences(pieces, mesh.group("cp"))
    if mesh.size("ep") > 1:
        # Tokens come from every dp x cp rank (the capacity is global); experts move over "ep".
        parallelize_experts(model, mesh.group("ep"), mesh.group("dp_cp"))
    elif cfg.model.n_experts and mesh.size("dp_cp") > 1:
        share_routing_counts(model, mesh.group("dp_cp"))   # global capacity
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)
    pipeline = None
    if mesh.size("pp") > 1:
        model = split_for_pipeline(model, ctx, seq_split)
        pipeline = Pipeline(functools.partial(pipeline_forward_backward, model),
                            loss_stage=model.loss_stage,           # the last stage, or a V's first
                            sum_stages=bool(cfg.model.n_experts))  # MoE: every stage adds its aux
    return RankModel(model, loss_fn=loss_fn, shard_batch=batch_chunks, pipeline=pipeline)
