"""Pipeline parallelism: one runner that executes any schedule table on a pp process group.

    chunks = build_chunks(build_model(cfg, seed), stages=p, stage=rank, virtual_stages=v)
    table = schedule_table(p, m, "1f1b")                  # refimpl.parallel.pp.schedules
    loss = run_schedule(chunks, table[rank], batch.micro_batches(m), group)   # last stage: the loss

Seed 000, sec. 3.4: each stage runs its layers on the micro-batches it receives from the previous
stage (activations, [b, s, d]) and sends back the gradient of those activations. The runner does not
know GPipe from 1F1B: the table is the schedule, and the runner follows it action by action.

  F(mb, c)  receive the activation (unless this is the first piece), run chunk c, send its output to
            the next piece (or, on the last piece, compute the micro-batch's loss, scaled by 1/m)
  B(mb, c)  receive the output gradient (unless last), backpropagate through chunk c, send the
            input's gradient back. zb-h1 splits it: B computes only the input gradient, and
  W(mb, c)  computes the weight gradients later (refimpl.parallel.pp.zero_bubble).

Why it cannot deadlock. Every send is an `isend`: posting it never waits for the receiver, so a
rank only ever waits in a receive, for data that an earlier action of another rank produces. Those
waits are exactly the dependencies that `simulate.simulate` replays; a table it can finish (every
table `schedule_table` makes: see `check_table`) finishes here too. With blocking sends, 1F1B's
steady state would hang: stage s sending an activation forward while stage s+1 sends a gradient back,
each waiting for the other to receive. Receives are posted one action ahead (`irecv`), so the next
micro-batch's data arrives while this one computes. Each message has its own tag (kind, micro-batch,
piece), so the order in which two ranks post them never matters.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from refimpl.comm import p2p
from refimpl.model import Batch, lm_loss

# schedule_table and bubble_fraction: DESIGN's contract names them here (refimpl.parallel.pp.runner).
from refimpl.parallel.pp.schedules import Action, bubble_fraction, schedule_table  # noqa: F401
from refimpl.parallel.pp.stage import StageChunk
from refimpl.parallel.pp.zero_bubble import WeightGradRecord, record_weight_grads
from refimpl.trace.labels import comm_span, phase

ACTIVATION, GRADIENT = 0, 1


class _Links:
    """Who sends what to whom: piece k lives on group rank k % p; each message has its own tag."""

    def __init__(self, group, n_chunks: int, micro_batches: int, like: torch.Tensor | None = None):
        self.group = group
        # Received activations and gradients take the residual stream's dtype and device: those
        # of the parameters (fp32; the compute dtype when ZeRO-3/FSDP gathers them in bf16; the
        # rank's GPU under NCCL).
        self.like = {} if like is None else {"dtype": like.dtype, "device": like.device}
        self.p = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.pieces, self.m = self.p * n_chunks, micro_batches
        self.sends: list = []                # (work, tensor): kept alive until the step ends
        self.posted: dict[int, tuple] = {}   # tag -> (work or None, buffer)
        self.local: dict[int, torch.Tensor] = {}   # messages to a piece on this same rank

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def piece(self, a: Action) -> int:
        return a.chunk * self.p + self.rank

    def tag(self, kind: int, mb: int, piece: int) -> int:
        return 1 + (kind * self.pieces + piece) * self.m + mb

    def incoming(self, a: Action):
        """(tag, source rank) of the message action `a` needs, or None (first F, last B, any W)."""
        k = self.piece(a)
        if a.kind == "F" and k > 0:
            return self.tag(ACTIVATION, a.micro_batch, k), (k - 1) % self.p
        if a.kind == "B" and k < self.pieces - 1:
            return self.tag(GRADIENT, a.micro_batch, k), (k + 1) % self.p
        return None

    def post_recv(self, a: Action, shape) -> None:
        need = self.incoming(a)
        if need is None or need[0] in self.posted or need[1] == self.rank:
            return
        buf = torch.empty(shape, **self.like)
        work = p2p.irecv(buf, group=self.group, tag=need[0], group_src=need[1])
        self.posted[need[0]] = (work, buf)

    def take(self, a: Action, shape) -> torch.Tensor:
        tag, src = self.incoming(a)
        if src == self.rank:
            return self.local.pop(tag)
        self.post_recv(a, shape)
        work, buf = self.posted.pop(tag)
        with comm_span("recv-wait", buf.numel() * buf.element_size(), group=self.group,
                       peer=self.global_rank(src), tag=tag,
                       phase=f"pp:{a.text(self.pieces > self.p)}"):
            work.wait()   # the only place a rank waits for another: the pipeline's bubble
        return buf

    def send(self, tensor: torch.Tensor, kind: int, mb: int, to_piece: int) -> None:
        tag, dst = self.tag(kind, mb, to_piece), to_piece % self.p
        if dst == self.rank:
            self.local[tag] = tensor
            return
        tensor = tensor.contiguous()
        self.sends.append((p2p.isend(tensor, group=self.group, tag=tag, group_dst=dst), tensor))

    def finish(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def run_schedule(chunks: list[StageChunk], actions: list[str], micro: list[Batch], group, *,
                 divisor: int = 1, autocast=nullcontext, loss_fn=lm_loss,
                 fault: str | None = None) -> torch.Tensor | None:
    """Run this rank's `actions` (one row of a schedule table) on `micro`, accumulating gradients
    into the chunks' parameters. Returns the mean loss over the micro-batches (each scaled by 1/m,
    then summed; a float64 0-d tensor on the device) on the rank that holds the last piece, None
    elsewhere. Gradients are those of
    loss / `divisor` (refimpl.step's convention: W for data-parallel replicas that sum).
    `loss_fn(logits, targets)`: the last piece's loss (tensor parallelism's reads split logits).
    `fault`: pp-loss-scaled-twice or p2p-misordered inject their bug (refimpl.faults)."""
    m = len(micro)
    parsed = [Action.parse(a) for a in actions]
    split = any(a.kind == "W" for a in parsed)
    links = _Links(group, len(chunks), m, like=next(chunks[0].parameters(), None))
    saved, records, total = {}, {}, None

    def shape(mb: int):
        rows, seq = micro[mb].inputs.shape   # sequence parallelism: s/t tokens between stages
        return (rows, seq // chunks[0].seq_split, chunks[0].d_model)

    for i, a in enumerate(parsed):
        for ahead in parsed[i:i + 2]:     # post this action's receive and the next one's
            links.post_recv(ahead, shape(ahead.micro_batch))
        key, k, chunk = (a.micro_batch, a.chunk), links.piece(a), chunks[a.chunk]
        label = a.text(len(chunks) > 1)
        if a.kind == "F":
            x = micro[a.micro_batch].inputs if k == 0 else links.take(a, shape(a.micro_batch)).requires_grad_()
            record = WeightGradRecord() if split else None
            with phase("forward"), phase(f"pp:{label}"):
                with (record_weight_grads(chunk, record) if split else nullcontext([])) as embeds:
                    with autocast():
                        out = chunk(x)
                if chunk.is_last:
                    with autocast():
                        loss = loss_fn(out, micro[a.micro_batch].targets) / m
                    # On the device, read once per step by the loop (no host sync here).
                    part = loss.detach().double()
                    total = part if total is None else total + part
                    out = loss / divisor if divisor != 1 else loss
                    if fault == "pp-loss-scaled-twice":
                        out = out / m       # the fault: the 1/m applied a second time
            if not chunk.is_last:   # after the compute range closes: a trace then shows the wait
                links.send(out.detach(), ACTIVATION, a.micro_batch, k + 1)
            saved[key], records[key] = (x, embeds, out), record
        elif a.kind == "B":
            x, embeds, out = saved.pop(key)
            if fault == "p2p-misordered" and links.rank == 0 and a.micro_batch == 0:
                # The fault: the first backward waits for the last micro-batch's gradient, which
                # stage 1 cannot send before the forwards this rank has not run yet: a hang.
                a = Action.parse(f"B{m - 1}")
            grad = None if chunk.is_last else links.take(a, shape(a.micro_batch))
            with phase("backward"), phase(f"pp:{label}"):
                dx = _backward(out, grad, x if k > 0 else None, embeds, split)
            if k > 0:
                links.send(dx, GRADIENT, a.micro_batch, k - 1)
        else:
            with phase("backward"), phase(f"pp:{label}"):
                records.pop(key).apply()
    links.finish()
    return total


def _backward(out, grad, x, embeds, split: bool):
    """B: the gradient of this piece's input x (None on the first piece, whose input is token ids).
    Without `split` this is the whole backward (weights too); with it, only the input gradient."""
    if not split:
        torch.autograd.backward(out, grad)
        return None if x is None else x.grad
    if x is not None:
        (dx,) = torch.autograd.grad(out, [x], grad)
        return dx
    grads = torch.autograd.grad(out, [o for _, o in embeds], grad)
    for (entry, _), g in zip(embeds, grads):
        entry[2] = g
    return None


def pipeline_forward_backward(stage, micro: list[Batch], *, divisor: int = 1,
                              autocast=nullcontext, loss_fn=lm_loss,
                              fault: str | None = None) -> torch.Tensor:
    """The step runner's pipeline branch (refimpl.step.forward_backward's contract): run this
    rank's row of the table on `micro`; returns the mean loss over the micro-batches as a float64
    0-d tensor on the last stage, zero elsewhere (global_mean_loss broadcasts it over pp)."""
    loss = run_schedule(stage.chunks, stage.actions, micro, stage.group, divisor=divisor,
                        autocast=autocast, loss_fn=loss_fn, fault=fault)
    device = micro[0].inputs.device
    return torch.zeros((), dtype=torch.float64, device=device) if loss is None else loss
