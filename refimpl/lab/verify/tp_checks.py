"""Tensor parallelism checked against the reference, layer by layer: what tests/test_tp.py and
notebook 06 assert on. `all_checks` runs on every rank of a launch (`launch.run(all_checks, t, V)`).

Each check builds the reference layer (the same on every rank: same seed), its tensor-parallel
version from it, runs both on the same input, and returns plain numbers: relative errors against
the reference (gathered over tp where the TP result is sharded), the communication log
(refimpl.lab.instrument.labels.CommLog) and the activation bytes autograd saved.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from refimpl.config import TrainConfig
from refimpl.cost.collective_bytes import sent_per_rank
from refimpl.lab.checkpoint.gather import gather_full_state_dict, unshard
from refimpl.lab.instrument.activations import measure_block_activations
from refimpl.lab.instrument.labels import CommLog
from refimpl.lab.verify.group_mesh import GroupMesh
from refimpl.launch import device_for
from refimpl.model import Block, GPTConfig, build_model, lm_loss, synthetic_batch
from refimpl.parallel.tp.attention import ParallelGroupedAttention, ParallelSelfAttention
from refimpl.parallel.tp.blocks import ParallelMLP
from refimpl.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear
from refimpl.parallel.tp.mappings import group_rank
from refimpl.parallel.tp.parallelize import parallelize_tp, sequence_partial, tp_loss_for
from refimpl.placement import placement_of
from refimpl.seam import phase
from refimpl.strategy import make_optimizer

BLOCK_CFG = GPTConfig(d_model=64, n_heads=8, n_layers=1, seq_len=16)
B, S = 2, 16


def tp_lm_loss(model: nn.Module, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy from this rank's vocabulary slice of the logits (equal to
    refimpl.model.lm_loss on the gathered logits, which are never built)."""
    return tp_loss_for(model.lm_head)(logits, targets)


def gather_tp_state_dict(model: nn.Module, group, grads: bool = False) -> dict:
    """The reference model's full state dict (or gradients) rebuilt from the tp ranks' shards."""
    local = ({n: (p.grad if p.grad is not None else torch.zeros_like(p))
              for n, p in model.named_parameters()} if grads else model.state_dict())
    return gather_full_state_dict(local, model, GroupMesh(tp=group))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _mine(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    return t.chunk(dist.get_world_size(group), dim=dim)[group_rank(group)]


def _log(log: CommLog) -> list:
    return [(c["op"], c["pass"], c["bytes"]) for c in log.calls]


def _grad_errors(ref: nn.Module, tp: nn.Module, group) -> float:
    """Worst relative error of tp's gradients (gathered to full shape) against ref's, by name."""
    ref_grads = dict(ref.named_parameters())
    return max(rel(_full(p.grad, p, group), ref_grads[n].grad) for n, p in tp.named_parameters())


def _full(t: torch.Tensor, p: torch.Tensor, group) -> torch.Tensor:
    shard = placement_of(p)
    return t if shard is None else unshard(t, shard, GroupMesh(tp=group))


def linear_checks(group, device="cpu") -> dict:
    torch.manual_seed(1)
    lin, x, dy = nn.Linear(16, 24), torch.randn(3, 5, 16), torch.randn(3, 5, 24)
    lin, x, dy = lin.to(device), x.to(device), dy.to(device)
    xr = x.clone().requires_grad_()
    lin(xr).backward(dy)
    out = {}
    for name, build, feed_full, out_full in [
        ("column", lambda: ColumnParallelLinear.from_linear(lin, group), True, False),
        ("column-gather", lambda: ColumnParallelLinear.from_linear(lin, group, gather_output=True),
         True, True),
        ("row", lambda: RowParallelLinear.from_linear(lin, group), False, True),
        ("row-full-input", lambda: RowParallelLinear.from_linear(lin, group, input_is_parallel=False),
         True, True),
    ]:
        layer = build()
        xin = (x if feed_full else _mine(x, -1, group)).clone().requires_grad_()
        with CommLog() as log:
            with phase("forward"):      # a collective's pass is the phase open around it
                y = layer(xin)
            with phase("backward"):
                y.backward(dy if out_full else _mine(dy, -1, group))
        want_y = lin(x) if out_full else _mine(lin(x), -1, group)
        want_dx = xr.grad if feed_full else _mine(xr.grad, -1, group)
        out[name] = {"y": rel(y, want_y), "dx": rel(xin.grad, want_dx),
                     "dw": _grad_errors(lin, layer, group), "log": _log(log)}
    return out


def block_checks(group, t: int, device="cpu") -> dict:
    """Parallel MLP, attention and a whole block against the reference block, with/without SP."""
    torch.manual_seed(2)
    out = {}
    for sp in (False, True):
        ref = Block(BLOCK_CFG).to(device)
        x, dy = (torch.randn(B, S, BLOCK_CFG.d_model).to(device) for _ in range(2))
        for part in ("mlp", "attn", "block"):
            ref.zero_grad()
            ref_part = ref if part == "block" else getattr(ref, part)
            tp_part = _tp_block(ref, group, sp) if part == "block" else (
                ParallelMLP.from_mlp(ref.mlp, group, sp) if part == "mlp"
                else ParallelSelfAttention.from_attention(ref.attn, group, sp))
            xr = x.clone().requires_grad_()
            ref_part(xr).backward(dy)
            xin = (_mine(x, 1, group) if sp else x).clone().requires_grad_()
            with CommLog() as log:
                with phase("forward"):
                    y = tp_part(xin)
                with phase("backward"):
                    y.backward(_mine(dy, 1, group) if sp else dy)
            want_y = ref_part(x)
            out[(part, sp)] = {
                "y": rel(y, _mine(want_y, 1, group) if sp else want_y),
                "dx": rel(xin.grad, _mine(xr.grad, 1, group) if sp else xr.grad),
                "dw": (_sp_grad_error if sp else _grad_errors)(ref_part, tp_part, group),
                "log": _log(log), "wire": wire_bytes(log.calls), "messages": log.message_bytes(),
                "activations": measure_block_activations(tp_part, xin.detach()),
                "reference_activations": measure_block_activations(ref_part, x),
            }
    return out


def _tp_block(ref: Block, group, sp: bool) -> Block:
    block = copy.deepcopy(ref)
    block.attn = ParallelSelfAttention.from_attention(ref.attn, group, sp)
    block.mlp = ParallelMLP.from_mlp(ref.mlp, group, sp)
    return block


def _sp_grad_error(ref: nn.Module, block: nn.Module, group) -> float:
    """Under SP the LayerNorm and row-bias gradients cover this rank's tokens: sum them first (what
    parallelize_tp's hooks do inside backward) and then compare everything."""
    for p in block.parameters():
        if placement_of(p) is None and p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    return _grad_errors(ref, block, group)


def model_checks(group, t: int, vocab: int, dtype=torch.float32, steps: int = 3,
                 device="cpu") -> dict:
    """parallelize_tp'd GPT vs the reference: state at init, first-step loss and grads, and
    `steps` AdamW steps (losses, final weights), with and without sequence parallelism."""
    cfg = GPTConfig(vocab_size=vocab)   # the loop's default model, as the equivalence gate uses
    train = TrainConfig()

    def fresh():
        return build_model(cfg, 0).to(device=device, dtype=dtype)

    ref = fresh()
    ref_opt = make_optimizer(ref.parameters(), train)
    ref_losses, ref_grads = [], None
    for step in range(steps):
        batch = synthetic_batch(cfg, 8, 32, 0, step).to(device)
        loss = lm_loss(ref(batch.inputs), batch.targets)
        loss.backward()
        ref_grads = ref_grads or {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step(), ref_opt.zero_grad()
        ref_losses.append(float(loss))
    out = {}
    for sp in (False, True):
        model = parallelize_tp(fresh(), group, sequence_parallel=sp)
        init = gather_tp_state_dict(model, group)
        same_init = all(torch.equal(init[k], v.cpu()) for k, v in fresh().state_dict().items())
        opt = make_optimizer(model.parameters(), train)
        losses, grad_err, local_numel = [], None, sum(p.numel() for p in model.parameters())
        for step in range(steps):
            batch = synthetic_batch(cfg, 8, 32, 0, step).to(device)
            with CommLog() as log:
                with phase("forward"):
                    loss = tp_lm_loss(model, model(batch.inputs), batch.targets)
                with phase("backward"):
                    loss.backward()
            if grad_err is None:
                grads = gather_tp_state_dict(model, group, grads=True)
                grad_err = max(rel(grads[n], g) for n, g in ref_grads.items())
                first_log = _log(log)
            opt.step(), opt.zero_grad()
            losses.append(float(loss))
        final = gather_tp_state_dict(model, group)
        partial = {id(p) for p in sequence_partial(model, sp and t > 1)}
        ref_state = {k: v.cpu() for k, v in ref.state_dict().items()}
        diff = sum(float((final[k].double() - v.double()).pow(2).sum()) for k, v in ref_state.items())
        norm = sum(float(v.double().pow(2).sum()) for v in ref_state.values())
        out[sp] = {"same_init": same_init,
                   "loss_rel_err": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
                   "grad_rel_err": grad_err, "weight_rel_err": (diff / norm) ** 0.5,
                   "keys_equal": final.keys() == ref_state.keys(), "log": first_log,
                   "local_numel": local_numel, "reference_numel": sum(
                       p.numel() for p in ref.parameters()),
                   "placements": {n: (placement_of(p), id(p) in partial)
                                  for n, p in model.named_parameters()}}
    return out


def tied_embedding_check(group, device="cpu") -> dict:
    """lm_head sharing embed.tok's weight: one shard serves both, and both names gather back."""
    cfg = GPTConfig(n_layers=1, tie_embeddings=True)
    ref = build_model(cfg, 0).to(device)
    model = parallelize_tp(build_model(cfg, 0).to(device), group)
    batch = synthetic_batch(cfg, 4, 32, 0, 0).to(device)
    ref_loss = lm_loss(ref(batch.inputs), batch.targets)
    ref_loss.backward()
    loss = tp_lm_loss(model, model(batch.inputs), batch.targets)
    loss.backward()
    state, grads = gather_tp_state_dict(model, group), gather_tp_state_dict(model, group, grads=True)
    return {"shared": model.lm_head.weight is model.embed.tok.weight,
            "same_state": all(torch.equal(state[k], v.cpu()) for k, v in ref.state_dict().items()),
            "loss": rel(loss, ref_loss),
            "grads": max(rel(grads[n], p.grad) for n, p in ref.named_parameters())}


def all_checks(rank: int, world: int, vocab: int = 512, models=("fp32", "fp64")) -> dict:
    """Every check on a tp group of the whole world, on the rank's device (a GPU under NCCL);
    `models` picks the whole-model runs."""
    group = dist.new_group(list(range(world)))
    device = device_for(dist.get_backend())
    out = {"linear": linear_checks(group, device), "block": block_checks(group, world, device)}
    out["tied"] = tied_embedding_check(group, device)
    if "fp32" in models:
        out["model"] = model_checks(group, world, vocab, device=device)
    if "fp64" in models:
        out["model64"] = model_checks(group, world, vocab, dtype=torch.float64, device=device)
    return out


_SHORT = {"forward": "fwd", "backward": "bwd"}


def results_table(per_rank: list[dict]):
    """One row per checked layer (worst rank): relative errors of output, input gradient and
    weight gradients, and the collectives it issued in order ("op/pass"), as a DataFrame."""
    import pandas as pd

    rows = []
    cases = [(name, None, ("linear", name)) for name in per_rank[0]["linear"]]
    cases += [(part, sp, ("block", (part, sp))) for part, sp in per_rank[0]["block"]]
    for name, sp, (kind, key) in cases:
        results = [r[kind][key] for r in per_rank]
        rows.append({"layer": name, "sequence_parallel": sp,
                     **{err: max(res[err] for res in results) for err in ("y", "dx", "dw")},
                     "collectives": ", ".join(f"{op} ({_SHORT[p]})" for op, p, _ in results[0]["log"])})
    return pd.DataFrame(rows).rename(columns={"y": "output rel. err", "dx": "input grad rel. err",
                                              "dw": "weight grads rel. err"})


def gqa_checks(rank: int, world: int, kv_heads=(1, 2, 4, 8)) -> list[dict]:
    """Grouped-query attention (refimpl.model.gqa, 8 query heads of 8) split over the `world`
    ranks of a launch, against the one-process layer, for each number of key/value heads: the K
    rows this rank holds, the heads they are, its outputs' and gradients' errors (its K and V
    gradients gathered whole, a shared head taken once), and the K it holds against every other
    rank's, to see which ranks share it. Run with launch.run(gqa_checks, t)."""
    device, group = device_for(rank), dist.group.WORLD
    rows = []
    for kv in kv_heads:
        torch.manual_seed(3)
        cfg = GPTConfig(arch="llama", d_model=64, n_heads=8, n_kv_heads=kv, seq_len=S)
        ref = Block(cfg).attn.to(device=device, dtype=torch.float64)
        x, dy = (torch.randn(B, S, cfg.d_model, dtype=torch.float64, device=device)
                 for _ in range(2))
        xr = x.clone().requires_grad_()
        ref(xr).backward(dy)
        tp = ParallelGroupedAttention.from_attention(ref, group)
        xin = x.clone().requires_grad_()
        tp(xin).backward(dy)
        held = [torch.empty_like(tp.k.weight) for _ in range(world)]
        dist.all_gather(held, tp.k.weight.detach().contiguous(), group=group)
        rows.append({"kv_heads": kv, "rank": rank, "K rows held": tp.k.weight.shape[0],
                     "ranks holding the same K": sum(torch.equal(h, tp.k.weight) for h in held),
                     "output error": rel(tp(x), ref(x)), "dx error": rel(xin.grad, xr.grad),
                     "weight grad error": _grad_errors(ref, tp, group)})
    return rows


def wire_bytes(calls: list[dict]) -> float:
    """Bytes one rank sends for calls {op, world, bytes}: each message times its op's factor on the
    call's own group size."""
    return sum(sent_per_rank(c["op"], c["world"], c["bytes"]) for c in calls)
