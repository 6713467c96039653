"""The collectives one rank calls in one step of a MoE model on dp x ep x tp x pp x cp, from the layout.

Notebook 09 traces such a run and counts the labelled calls of a rank per step
(refimpl.lab.plan.composition.collectives_per_step); this is the arithmetic they must equal, one row per
(axis, op, pass), so a trace that called one more all-to-all or one fewer send fails the comparison.
L is the stage's MoE layers (every block of a MoE model is one), m the micro-batches, e = E/ep the
experts this rank holds of each layer:

  ep   per MoE layer and micro-batch: one all-gather of the routing counts over the token-holding
       ranks (refimpl.model.moe), and five all-to-alls (refimpl.parallel.ep.dispatch: the kept
       counts, the dispatch and the combine in forward; the combine's and the dispatch's backward).
       Every tp rank runs them at its own tp coordinate (its ep group is a chunk of its dp x cp group).
  tp   per micro-batch (refimpl.parallel.tp): attention enters its region once and leaves it once
       (layers.ParallelSelfAttention: f before Q, K, V; g after O), one collective each way each pass;
       the MoE layer splits every expert over tp (tp/experts.py, Megatron's expert tensor
       parallelism), so each of the e experts this rank holds is a ParallelMLP with its own f and g:
       one all-reduce of its routed rows in forward, one in backward -- the experts run even on zero
       rows (refimpl.parallel.ep.dispatch, step 3), so the count does not depend on the routing. The
       router is replicated and needs none. The first stage's vocabulary-parallel embedding sums its
       rows (tp/vocab.py: forward only); the last stage's output layer is column-parallel (f: one
       all-reduce in backward) and its cross-entropy reduces three numbers per token in forward (a
       max, the target's logit, the sum of exponentials).
       Sequence parallelism turns each f into an all-gather (backward: reduce-scatter) and each g into
       a reduce-scatter (backward: all-gather); the MoE layer is a replicated region inside it (its
       input gathered along the sequence, its output cut back: one all-gather in forward, one in
       backward) whose experts keep their all-reduces; and every parameter applied to split tokens
       (LayerNorms, attention's O bias, the position table) all-reduces its gradient over tp in each
       backward (tp/parallelize.py's hook).
  pp   per micro-batch, one activation sent forward unless the stage is the last and one gradient
       sent back unless it is the first, each met by a posted receive and its wait
       (refimpl.parallel.pp.runner); and once a step, the all-reduce that sums the stages' parts of
       the loss (every stage adds its MoE layers' aux loss: refimpl.step.global_mean_loss).
  cp   per block and micro-batch, ring attention's hops (refimpl.parallel.cp.ring): in forward
       cp - 1 K/V blocks passed on, in backward cp - 1 again and cp hops of the accumulated dK/dV,
       each hop one isend and one irecv. They are posted by refimpl.comm.p2p.post, which labels no
       profiler range, so a trace does not show them: their rows say `traced=False` and the trace
       comparison leaves them out (tests/test_cp.py counts the ring's messages instead). Under capacity_scope=sequence, per MoE layer and micro-batch,
       one all-gather over cp of the counts of each sequence's pieces (refimpl.parallel.ep.counts).
  dp   `ep`'s gradient sync after the schedule (dp-naive's: refimpl.parallel.dp.naive): one
       all-reduce per dense parameter tensor of the stage over dp x cp, one per expert tensor over
       edp when edp > 1 (under tp each rank syncs its own shards, so the same tensors), and the
       loss's mean.

Counted: the plain pipeline placement (one chunk per rank), no activation checkpointing (which
replays a block's forward collectives in backward), and not tp with cp together (tp x cp's MoE run
is not checked against a trace here).
"""
from __future__ import annotations

import pandas as pd

from refimpl.config import TrainConfig
from refimpl.model import build_model
from refimpl.parallel.pp.schedules import pipeline_schedule, placement
from refimpl.parallel.pp.stage import partition


def stage_tensors(cfg: TrainConfig, stage: int) -> tuple[int, int, int]:
    """(MoE layers, replicated parameter tensors, expert tensors per ep rank) of pipeline `stage`."""
    names = _stage_names(cfg, stage)
    experts = sum(".experts." in n for n in names)
    return len(_stage_blocks(cfg, stage)), len(names) - experts, experts // cfg.dims.ep


def _stage_blocks(cfg: TrainConfig, stage: int) -> range:
    return partition(cfg.model.n_layers, cfg.pp)[stage] if cfg.pp > 1 else range(cfg.model.n_layers)


def _stage_names(cfg: TrainConfig, stage: int) -> list[str]:
    p = cfg.pp
    mine = {f"blocks.{i}." for i in _stage_blocks(cfg, stage)}
    heads = (("embed.",) if stage == 0 else ()) + (("final_norm.", "lm_head.") if stage == p - 1 else ())
    return [n for n, _ in build_model(cfg.model, seed=0).named_parameters()
            if n.startswith(heads) or any(n.startswith(b) for b in mine)]


def sequence_partial_tensors(cfg: TrainConfig, stage: int) -> int:
    """Parameters of the stage that tp/parallelize.py marks partial over the sequence under SP:
    the LayerNorms, the position table, and the row-parallel biases of attention and of dense MLPs
    (an expert's MLP is built without SP, tp/experts.py, so its `down` bias is not one)."""
    dense_down = () if cfg.model.n_experts else (".mlp.down.bias",)
    return sum(n.startswith(("final_norm.", "embed.pos.")) or ".ln1." in n or ".ln2." in n
               or n.endswith((".attn.o.bias",) + dense_down)
               for n in _stage_names(cfg, stage))


def _tp_rows(cfg: TrainConfig, stage: int, layers: int) -> list[tuple]:
    """tp's (op, pass, calls) per step on a rank of `stage` (see the module's docstring)."""
    m, e = cfg.micro_batches, cfg.model.n_experts // cfg.dims.ep
    first, last = int(stage == 0), int(stage == cfg.pp - 1)
    if not cfg.sequence_parallel:
        return [("all_reduce", "forward", m * (first + layers * (1 + e) + 2 * last)),
                ("all_reduce_max", "forward", m * last),
                ("all_reduce", "backward", m * (layers * (1 + e) + last))]
    return [("all_gather", "forward", m * (2 * layers + last)),
            ("reduce_scatter", "forward", m * (first + layers)),
            ("all_reduce", "forward", m * (layers * e + 2 * last)),
            ("all_reduce_max", "forward", m * last),
            ("all_gather", "backward", m * (2 * layers + first)),
            ("reduce_scatter", "backward", m * (layers + last)),
            ("all_reduce", "backward", m * (layers * e + sequence_partial_tensors(cfg, stage)))]


def ring_hops(cp: int) -> dict[str, int]:
    """Messages one rank sends in one ring attention (refimpl.parallel.cp.ring.RingAttention), per
    pass: forward passes K/V on cp - 1 times; backward passes them on cp - 1 times and the
    accumulated dK/dV cp times, home again after the last hop (tests/test_cp.py counts them)."""
    return {"forward": cp - 1, "backward": 2 * cp - 1 if cp > 1 else 0}


def _cp_rows(cfg: TrainConfig, layers: int) -> list[tuple]:
    """cp's (op, pass, calls, traced) per step (see the module's docstring)."""
    m = cfg.micro_batches
    ring = [(op, pass_, m * layers * hops, False) for op in ("isend", "irecv")
            for pass_, hops in ring_hops(cfg.cp).items()]
    pieces = cfg.model.capacity_scope == "sequence"
    return ring + [("all_gather", "forward", m * layers if pieces else 0, True)]


def expected_calls(cfg: TrainConfig, stage: int = 0) -> pd.DataFrame:
    """(axis, op, pass, calls, traced): what a rank of pipeline `stage` calls in one step of `cfg`
    (strategy ep); `traced` is False for calls no profiler range labels (cp's ring)."""
    if (cfg.cp > 1 and cfg.tp > 1) or cfg.activation_checkpointing or (
            cfg.pp > 1 and (placement(pipeline_schedule(cfg)) != "loop" or cfg.virtual_stages > 1)):
        raise ValueError("expected_calls counts dp x ep x tp x pp (or x cp without tp) with one chunk "
                         "per rank, without checkpointing")
    if cfg.strategy != "ep" or cfg.model.n_experts == 0:
        raise ValueError("expected_calls counts the `ep` strategy's sync on a MoE model")
    dims, m, p = cfg.dims, cfg.micro_batches, cfg.pp
    layers, replicated, experts = stage_tensors(cfg, stage)
    dp_cp, edp = dims.dp * dims.cp, dims.size("edp")
    sends = m * ((stage < p - 1) + (stage > 0)) if p > 1 else 0
    rows = [("ep", "all_gather", "forward", layers * m if dp_cp > 1 else 0),
            ("ep", "all_to_all", "forward", 3 * layers * m if dims.ep > 1 else 0),
            ("ep", "all_to_all", "backward", 2 * layers * m if dims.ep > 1 else 0)]
    rows += [("tp", op, pass_, calls) for op, pass_, calls in _tp_rows(cfg, stage, layers)
             if cfg.tp > 1]
    rows += [("cp", op, pass_, calls) for op, pass_, calls, _ in _cp_rows(cfg, layers) if cfg.cp > 1]
    rows += [("pp", "isend", "step", sends), ("pp", "irecv", "step", sends),
             ("pp", "recv-wait", "step", sends), ("pp", "all_reduce", "loss", 1 if p > 1 else 0),
             ("dp", "all_reduce", "grad sync", (replicated if dp_cp > 1 else 0) + (experts if edp > 1 else 0)),
             ("dp", "all_reduce", "loss", 1 if dp_cp > 1 else 0)]
    table = pd.DataFrame(rows, columns=["axis", "op", "pass", "calls"])
    untraced = {(op, pass_) for op, pass_, _, traced in _cp_rows(cfg, layers) if not traced}
    table["traced"] = [not (axis == "cp" and (op, pass_) in untraced)
                       for axis, op, pass_ in zip(table.axis, table.op, table["pass"])]
    return table.query("calls > 0").reset_index(drop=True)


def count_gather_bytes(cfg: TrainConfig) -> int:
    """Bytes of ep's all-gather of the routing counts: int64 counts per expert (routed and kept
    under the sequence scope, routed under the batch scope) from every dp x cp rank
    (refimpl.parallel.ep.counts: `SharedCounts.gather_counts`)."""
    rows = 2 if cfg.model.capacity_scope == "sequence" else 1
    return 8 * rows * cfg.model.n_experts * cfg.dims.dp * cfg.dims.cp


def piece_gather_bytes(cfg: TrainConfig) -> int:
    """Bytes of cp's all-gather of the pieces' counts under capacity_scope=sequence: int64 counts
    [rows of a micro-batch, 2 pieces held (ring attention's head-tail chunks), E] from every cp rank."""
    rows = cfg.global_batch // (cfg.dims.dp * cfg.micro_batches)
    return 8 * rows * 2 * cfg.model.n_experts * cfg.cp


def measured_calls(trace: pd.DataFrame, cfg: TrainConfig, rank: int) -> pd.DataFrame:
    """(axis, op) x step: the labelled collectives of `rank` in each step of a traced run of `cfg`,
    each put on its axis. A label names the op, not the group, so the axis is read from the op and
    from when the call ran (refimpl.strategy.Strategy.train_step's order): all-to-alls are ep's, the
    sends and receives pp's (cp's ring is not labelled); an all-gather is ep's when it carries the
    routing counts (`count_gather_bytes`), cp's when it carries the pieces' (`piece_gather_bytes`),
    and tp's otherwise; any other call is tp's while the schedule runs (up to
    the end of its last forward or backward), dp's gradient sync after it, and after the optimizer
    the loss's reductions: dp x cp's mean, then pp's sum of the stages' parts
    (refimpl.step.global_mean_loss)."""
    counts, pieces = count_gather_bytes(cfg), piece_gather_bytes(cfg) if cfg.cp > 1 else None
    if counts == pieces:
        raise ValueError("ep's and cp's count all-gathers carry the same bytes here: the trace cannot "
                         "tell them apart")
    mine = trace[(trace["rank"] == rank) & trace.step.notna()]
    rows = []
    for step, calls in mine.groupby("step"):
        compute = calls[calls.category.isin(["forward", "backward"])]
        schedule_end = (compute.start_us + compute.dur_us).max()
        optimizer = calls[calls.category == "optimizer"].start_us.min()
        loss_axes = iter(["dp"] * (cfg.dims.size("dp_cp") > 1) + ["pp"] * (cfg.pp > 1))
        comm = calls[calls.name.str.startswith("comm:") & calls.bytes.notna()].sort_values("start_us")
        for call in comm.itertuples():
            if call.op == "all_to_all" or (call.op == "all_gather" and call.bytes == counts):
                axis = "ep"
            elif call.op == "all_gather" and call.bytes == pieces:
                axis = "cp"
            elif call.op in ("isend", "irecv", "recv-wait"):
                axis = "pp"
            elif call.start_us >= optimizer:
                axis = next(loss_axes, "?")
            else:
                axis = "dp" if call.start_us >= schedule_end else "tp"
            rows.append((axis, call.op, f"step {int(step)}"))
    table = pd.DataFrame(rows, columns=["axis", "op", "step"])
    return table.groupby(["axis", "op", "step"]).size().unstack("step", fill_value=0).reset_index()


def against_trace(cfg: TrainConfig, trace: pd.DataFrame, rank: int) -> pd.DataFrame:
    """One row per (axis, op): the arithmetic's calls for `rank`'s stage (`expected`) beside the
    trace's, per step."""
    stage = cfg.dims.coordinates(rank)["pp"]
    expected = calls_by_axis(expected_calls(cfg, stage).query("traced"))
    expected = expected.rename(columns={"calls": "expected"})
    table = expected.merge(measured_calls(trace, cfg, rank), on=["axis", "op"], how="outer")
    return table.fillna(0).astype({c: int for c in table.columns if c not in ("axis", "op")})


def calls_by_op(expected: pd.DataFrame) -> dict[str, int]:
    """Calls per op, summed over the axes (what a trace, which does not know the axis, counts)."""
    return expected.query("traced").groupby("op").calls.sum().to_dict()


def calls_by_axis(expected: pd.DataFrame) -> pd.DataFrame:
    """Calls per (axis, op), summed over the passes: the table a notebook shows."""
    return expected.groupby(["axis", "op"], sort=False).calls.sum().reset_index()
