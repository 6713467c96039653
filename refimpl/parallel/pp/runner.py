"""Pipeline parallelism: one runner that executes any schedule table on a pp process group.

    chunks = build_chunks(build_model(cfg, seed), stages=p, stage=rank, virtual_stages=v)
    table = schedule_table(p, m, "1f1b")                  # refimpl.parallel.pp.schedules
    loss = run_schedule(chunks, table, batch.micro_batches(m), group)   # last stage: the loss

Seed 000, sec. 3.4: each stage runs its layers on the micro-batches it receives from the previous
stage (activations, [b, s, d]) and sends back the gradient of those activations. The runner does not
know GPipe from 1F1B: the table is the schedule, and the runner follows it action by action.

  F(mb, c)  receive the activation (unless this is the first piece), run chunk c, send its output to
            the next piece (or, on the last piece, compute the micro-batch's loss, scaled by 1/m)
  B(mb, c)  receive the output gradient (unless last), backpropagate through chunk c, send the
            input's gradient back. zb-h1 splits it: B computes only the input gradient, and
  W(mb, c)  computes the weight gradients later (refimpl.parallel.pp.zero_bubble). Where a
            row has W right after its own B, nothing runs between them for the split to let go
            first, so that B is the whole backward and that W is empty (`whole_backwards`).

  F&B       an overlapped pair (dualpipev): F, then B, with B's receive already posted.

Why it cannot deadlock. Every send is an `isend`: posting it never waits for the receiver, so a
rank only ever waits in a receive, for data that an earlier action of another rank produces. Those
waits are exactly the dependencies that `simulate.simulate` replays; a table it can finish (every
table `schedule_table` makes: see `check_table`) finishes here too. With blocking sends, 1F1B's
steady state would hang: stage s sending an activation forward while stage s+1 sends a gradient back,
each waiting for the other to receive. Receives are posted ahead (`irecv`), so the next
micro-batch's data arrives while this one computes: on gloo all of a step's before its first action
(`links.posting` says why); elsewhere as below.

What that argument assumes, and NCCL does not give. It takes every posted operation to progress
on its own, as on gloo. NCCL runs the operations between two ranks in the order they were posted,
on one stream, and a send may wait until the peer's matching receive starts (NVIDIA/nccl#479,
#783): a receive posted ahead then holds back a later send, and the ahead-posting above hangs
every schedule (refimpl.parallel.pp.nccl_order replays it: in 1F1B stage 0 posts B0's receive
before F1's send, while stage 1 waits for F1 before sending B0's gradient). Off gloo (NCCL, and
the staged backend that stands in for it here) the runner therefore posts every send and receive
of the step one at a time in one global order, the time each message is produced in the table's
replay (`nccl_order.global_order`, whose docstring has the argument); `nccl_order.replay` checks
every schedule on 2-4 stages under NCCL's rules. Not yet run on several GPUs. The runner picks the
posting from the group's backend itself (`links.posting`) and derives the order from the whole
table it is given, so no caller can run NCCL with gloo's posting by leaving an argument out.

Why the messages pair right. NCCL ignores tags: between two ranks it pairs the k-th send with the
k-th receive posted. Interleaved and the V schedules (rank r's two chunks talk to the same
neighbour, r-1 and r+1, in both directions: activations down chunk 0 and gradients up chunk 1 to
r+1, the reverse to r-1) make each link carry both kinds, and in a V table the receiver may want
them in another order than the sender sends them (simulate.posting_order_mismatch: zbv's rank 1
wants chunk 1's first gradient before the activation rank 0 sends first). So, given its `inbox`
(simulate.inbox: per sender, the messages in the sender's order, from the whole table), a rank
posts its receives from each sender in *that* order: to receive message k it first posts every
earlier one from the same sender. Posting early never blocks, and the waits stay those above. The
tags (kind, micro-batch, piece) remain, but the pairing no longer depends on them
(REFIMPL_P2P_TAGS=one runs every schedule with tag 0: tests/test_nccl_rules.py).

What overlaps on gloo. gloo moves a posted message on its own thread, so a rank's compute overlaps
the transfers of messages already posted: in an F&B pair, the B's incoming gradient arrives while
the F computes, and the F's outgoing activation leaves while the B computes. The two computes do
not overlap each other: one process, one CPU stream (OMP_NUM_THREADS=1), F then B. On a GPU
DualPipe runs the pair's two computes on two streams to hide an expert all-to-all under the other
half; nothing here can show that, and sequential actions with receives posted ahead get the same
message overlap as a pair does.
"""
from __future__ import annotations

from contextlib import nullcontext
from functools import lru_cache

import torch
import torch.distributed as dist

from refimpl.labels import phase
from refimpl.model import Batch, lm_loss
from refimpl.model.moe import moe_aux_loss, moe_layers
from refimpl.parallel.pp.links import ACTIVATION, GRADIENT, Links, posting
from refimpl.parallel.pp.nccl_order import rank_order

# schedule_table and bubble_fraction: DESIGN's contract names them here (refimpl.parallel.pp.runner).
from refimpl.parallel.pp.schedules import (  # noqa: F401
    Action,
    bubble_fraction,
    parse_entry,
    piece_of,
    rank_of,
    schedule_table,
)
from refimpl.parallel.pp.simulate import inbox as table_inbox
from refimpl.parallel.pp.stage import StageChunk
from refimpl.parallel.pp.zero_bubble import WeightGradRecord, chunk_layers, record_weight_grads


def run_schedule(chunks: list[StageChunk], table: list[list[str]], micro: list[Batch], group, *,
                 divisor: int = 1, autocast=nullcontext, loss_fn=lm_loss, where: str = "loop",
                 fault: str | None = None) -> torch.Tensor | None:
    """Run this rank's row of `table` (the whole schedule table, schedules.schedule_table: row r
    is pp group rank r's) on `micro`, accumulating gradients
    into the chunks' parameters. Returns the mean loss over the micro-batches (each scaled by 1/m,
    then summed; a float64 0-d tensor on the device) on the rank that holds the last piece, None
    elsewhere; with MoE layers, every rank's return adds its chunks' aux losses (1/m each), and
    the step sums the ranks' returns over pp. Gradients are those of
    loss / `divisor` (refimpl.step's convention: W for data-parallel replicas that sum).
    `loss_fn(logits, targets)`: the last piece's loss (tensor parallelism's reads split logits).
    `where`: the placement of the chunks (schedules.placement). The posting order (the module
    docstring) is the backend's (`links.posting`), read off the whole table here, not passed in.
    `fault`: pp-loss-scaled-twice or p2p-misordered inject their bug (refimpl.faults)."""
    m = len(micro)
    rank = 0 if group is None else dist.get_rank(group)

    def shape(mb: int):
        rows, seq = micro[mb].inputs.shape   # sequence parallelism: s/t tokens between stages
        return (rows, seq // chunks[0].seq_split, chunks[0].d_model)

    how = posting(group)
    entries, inbox, order = _plan(tuple(map(tuple, table)), rank, where, how == "ordered")
    split = any(a.kind == "W" for e in entries for a in e)
    # Per chunk, once per step: its layers for zero bubble's W, whether it has experts.
    layers = [chunk_layers(c) for c in chunks] if split else None
    experts = [bool(moe_layers(c)) for c in chunks]
    whole = whole_backwards(entries, [cl.plain for cl in layers]) if split else frozenset()
    links = Links(group, len(chunks), m, like=next(chunks[0].parameters(), None), where=where,
                  inbox=inbox, shape=shape, order=order)
    saved, records, total = {}, {}, None
    parsed = [(i, a) for i, e in enumerate(entries) for a in e]
    if how == "whole-step":
        for _, a in parsed:
            links.post_recv(a)
    for i, a in parsed:
        if how == "ahead":      # this entry's receives, the next's (the others post them elsewhere)
            for ahead in (b for e in entries[i:i + 2] for b in e):
                links.post_recv(ahead)
        key, k, chunk = (a.micro_batch, a.chunk), links.piece(a), chunks[a.chunk]
        label = a.text(len(chunks) > 1)
        if a.kind == "F":
            x = micro[a.micro_batch].inputs if k == 0 else links.take(a).requires_grad_()
            record = WeightGradRecord() if split and key not in whole else None
            with phase("forward"), phase(f"pp:{label}"):
                with (record_weight_grads(chunk, record, layers[a.chunk]) if record is not None
                      else nullcontext([])) as embeds:
                    with autocast():
                        out = chunk(x)
                # The MoE layers of this chunk: their aux loss joins the step's loss here, on the
                # stage that computed it (single adds every layer's to its micro-batch's loss).
                aux = moe_aux_loss(chunk) if experts[a.chunk] else 0.0
                if chunk.is_last:
                    with autocast():
                        loss = (loss_fn(out, micro[a.micro_batch].targets) + aux) / m
                    # On the device, read once per step by the loop (no host sync here).
                    part = loss.detach().double()
                    total = part if total is None else total + part
                    out = loss / divisor if divisor != 1 else loss
                    if fault == "pp-loss-scaled-twice":
                        out = out / m       # the fault: the 1/m applied a second time
                    aux = None
                elif isinstance(aux, torch.Tensor):
                    aux = aux / m
                    part = aux.detach().double()
                    total = part if total is None else total + part
                    aux = None if not aux.requires_grad else aux / divisor if divisor != 1 else aux
                else:
                    aux = None          # a dense chunk
            if not chunk.is_last:   # after the compute range closes: a trace then shows the wait
                links.send(out.detach(), ACTIVATION, a.micro_batch, k + 1)
            saved[key], records[key] = (x, embeds, out, aux), record
        elif a.kind == "B":
            x, embeds, out, aux = saved.pop(key)
            if fault == "p2p-misordered" and links.rank == 0 and a.micro_batch == 0:
                # The fault: the first backward waits for the last micro-batch's gradient, which
                # stage 1 cannot send before the forwards this rank has not run yet: a hang.
                a = Action.parse(f"B{m - 1}")
                links.post_ahead(a)
            grad = None if chunk.is_last else links.take(a)
            with phase("backward"), phase(f"pp:{label}"):
                dx = _backward(out, grad, x if k > 0 else None, embeds, split and key not in whole, aux)
            if k > 0:
                links.send(dx, GRADIENT, a.micro_batch, k - 1)
        else:
            record = records.pop(key)
            with phase("backward"), phase(f"pp:{label}"):   # empty when its B was whole: a trace
                if record is not None:                     # still has every action of the table
                    record.apply()
    links.finish()
    return total


def whole_backwards(entries: list, plain: list[bool]) -> frozenset:
    """The (micro-batch, chunk) whose B is directly followed, in this rank's row, by its own W (the
    B alone or last in its entry, the W alone in the next), on a chunk that can take a plain
    backward (`plain`, zero_bubble.ChunkLayers': no experts, whose aux loss the split handles,
    and no ZeRO-3/FSDP unit, which the split's W must not reread).

    Zero bubble splits B from W so that W can wait for a bubble; with nothing between them there
    is nothing for it to wait for, and the split only costs: the forward's hooks that keep every
    layer's X and dY, a second pass over the layers, LayerNorm's x_hat recomputed. One plain
    backward computes the same gradients with autograd's own products (in another summation order:
    equal to the split at float64's tolerance, not bit for bit). The input gradient then goes out
    after the weight products instead of before, as with PyTorch's pipelining, which merges such
    a pair into one full backward too (its schedules' `_merge_bw`)."""
    whole = set()
    for entry, after in zip(entries, entries[1:]):
        b = entry[-1]               # an overlapped pair (F&B) runs its B last
        if len(after) == 1 and (b.kind, after[0].kind) == ("B", "W"):
            w = after[0]
            if (b.micro_batch, b.chunk) == (w.micro_batch, w.chunk) and plain[b.chunk]:
                whole.add((b.micro_batch, b.chunk))
    return frozenset(whole)


@lru_cache(maxsize=64)
def _plan(table: tuple, rank: int, where: str, ordered: bool) -> tuple[list, dict, list | None]:
    """This rank's row, parsed (a list of entries, each a list of actions); its receive order per
    sender (simulate.inbox); and, when `ordered`, its sends and receives in the step's one order
    (nccl_order.rank_order): pure functions of the table, so computed once per table, not every
    step (the runner and the links read them, never change them)."""
    rows = [list(row) for row in table]
    return ([parse_entry(e) for e in rows[rank]], table_inbox(rows, rank, where),
            rank_order(rows, rank, where) if ordered else None)


def _backward(out, grad, x, embeds, split: bool, aux=None):
    """B: the gradient of this piece's input x (None on the first piece, whose input is token ids).
    Without `split` this is the whole backward (weights too); with it, only the input gradient.
    `aux`: a middle piece's MoE aux loss (already scaled), backpropagated with its output."""
    outs, grads = ([out], [grad]) if aux is None else ([out, aux], [grad, torch.ones_like(aux)])
    if not split:
        torch.autograd.backward(outs, grads)
        return None if x is None else x.grad
    if x is not None:
        (dx,) = torch.autograd.grad(outs, [x], grads)
        return dx
    grads = torch.autograd.grad(outs, [o for _, o in embeds], grads)
    for (entry, _), g in zip(embeds, grads):
        entry[2] = g
    return None


def pipeline_forward_backward(stage, micro: list[Batch], *, divisor: int = 1,
                              autocast=nullcontext, loss_fn=lm_loss,
                              fault: str | None = None) -> torch.Tensor:
    """The step runner's pipeline branch (refimpl.step.forward_backward's contract): run this
    rank's row of the table on `micro`; returns the mean loss over the micro-batches as a float64
    0-d tensor on the last stage, zero elsewhere (global_mean_loss broadcasts it over pp)."""
    loss = run_schedule(stage.chunks, stage.table, micro, stage.group, divisor=divisor,
                        autocast=autocast, loss_fn=loss_fn, where=stage.where, fault=fault)
    device = micro[0].inputs.device
    return torch.zeros((), dtype=torch.float64, device=device) if loss is None else loss
