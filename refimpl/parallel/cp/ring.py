"""Ring attention over a cp process group (seed 001: 컨텍스트 병렬화; Liu et al. 2023, sec. 3)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from refimpl.comm.p2p import GroupView, post
from refimpl.seam import span


def chunk_ids(rank: int, cp: int, balanced: bool = True) -> tuple[int, int]:
    """The two of the 2·cp sequence chunks that `rank` holds: head-tail, or contiguous."""
    return (rank, 2 * cp - 1 - rank) if balanced else (2 * rank, 2 * rank + 1)


def shard_sequence(x: torch.Tensor, rank: int, cp: int, *, balanced: bool = True,
                   dim: int = 1) -> torch.Tensor:
    """This rank's part of a full-sequence tensor: its two chunks, concatenated in order."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} must be divisible by 2*cp = {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp, balanced)], dim=dim)


@dataclass(frozen=True)
class RingPlace:
    """A cp rank's place on the ring: its group, its index, the ring's size, the chunk order."""
    group: object
    rank: int
    cp: int
    balanced: bool = True

    def positions(self, length: int, device=None) -> torch.Tensor:
        """The global positions of this rank's `length` tokens (its chunks of cp·length)."""
        everyone = torch.arange(length * self.cp, device=device).unsqueeze(0)
        return shard_sequence(everyone, self.rank, self.cp, balanced=self.balanced)[0]


def blocks_to_compute(mine: tuple[int, int], theirs: tuple[int, int]):
    """(my local chunk, their local chunk, on the diagonal?) for every score block that has an
    unmasked entry: query chunk i sees key chunk j only if j <= i; j == i needs the causal mask."""
    return [(a, b, i == j) for a, i in enumerate(mine) for b, j in enumerate(theirs) if j <= i]


# --- one block, forward and backward (FlashAttention's equations, Dao et al. 2022, Alg. 1-2) ---

def _scores(q, k, scale, diagonal):
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of what is summed across blocks (O, its log-sum-exp, dQ, dK, dV): at least fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge(o, lse, o_new, lse_new):
    """Combine two partial softmax outputs by their log-sum-exp (None: nothing yet)."""
    if o is None:
        return o_new, lse_new
    lse_out = torch.logaddexp(lse, lse_new)
    return (o * (lse - lse_out).exp().unsqueeze(-1)
            + o_new * (lse_new - lse_out).exp().unsqueeze(-1)), lse_out


def _shift(g: GroupView | None, tensor: torch.Tensor):
    """Send `tensor` to the next rank, receive the previous one's: (pending, incoming buffer)."""
    incoming = torch.empty_like(tensor)
    with span("cp"):
        pending = post(g, sends=[(tensor, (g.rank + 1) % g.size)],
                       recvs=[(incoming, (g.rank - 1) % g.size)])
    return pending, incoming


def _place(group) -> tuple[GroupView | None, int, int]:
    """(the ring's view, its size, my rank on it); group None is one rank."""
    g = GroupView.of(group) if group is not None else None
    return (g, g.size, g.rank) if g is not None else (None, 1, 0)


def _ring_steps(group, balanced: bool, kv: torch.Tensor):
    """The ring's cp steps: yields (the score blocks to compute, the K/V block in hand), sending each
    block on to the next rank before it is used (the overlap) and awaiting the previous rank's after."""
    g, cp, rank = _place(group)
    mine = chunk_ids(rank, cp, balanced)
    for step in range(cp):
        if step < cp - 1:
            pending, incoming = _shift(g, kv)
        yield blocks_to_compute(mine, chunk_ids((rank - step) % cp, cp, balanced)), kv
        if step < cp - 1:
            pending.wait()
            kv = incoming


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole ring's keys; [b, h, 2c, d] tensors."""

    @staticmethod
    def forward(ctx, q, k, v, group, balanced):
        scale = 1.0 / math.sqrt(q.shape[-1])
        qs, acc = q.chunk(2, dim=-2), accumulation_dtype(q.dtype)
        out, lse = [None, None], [None, None]
        for blocks, kv in _ring_steps(group, balanced, torch.stack([k, v]).contiguous()):
            ks, vs = kv[0].chunk(2, dim=-2), kv[1].chunk(2, dim=-2)
            for a, b, diagonal in blocks:
                s = _scores(qs[a], ks[b], scale, diagonal)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = (s - block_lse.unsqueeze(-1)).exp() @ vs[b]
                out[a], lse[a] = _merge(out[a], lse[a], block_out.to(acc), block_lse.to(acc))
        # Every query chunk met its own diagonal block at step 0, so no row is left empty.
        out, lse = torch.cat(out, dim=-2).to(q.dtype), torch.cat(lse, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balanced = group, balanced
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        g, cp, _ = _place(ctx.group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        grad_out = grad_out.contiguous()
        # D_i = rowsum(dO ∘ O): the softmax Jacobian's correction term (FlashAttention Alg. 2).
        acc = lse.dtype
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
        qs, dos, lses, deltas = (t.chunk(2, dim=-2 if t.dim() == 4 else -1)
                                 for t in (q, grad_out, lse, delta))
        dq = torch.zeros_like(q, dtype=acc)
        dqs = dq.chunk(2, dim=-2)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv, dtype=acc)   # gradient of the block we hold; travels with it
        for blocks, kv in _ring_steps(ctx.group, ctx.balanced, kv):
            ks, vs = kv[0].chunk(2, dim=-2), kv[1].chunk(2, dim=-2)
            dks, dvs = dkv[0].chunk(2, dim=-2), dkv[1].chunk(2, dim=-2)
            for a, b, diagonal in blocks:
                p = (_scores(qs[a], ks[b], scale, diagonal) - lses[a].unsqueeze(-1)).exp()
                dvs[b].add_(p.to(q.dtype).transpose(-2, -1) @ dos[a])
                ds = (p * (dos[a] @ vs[b].transpose(-2, -1) - deltas[a].unsqueeze(-1))).to(q.dtype)
                dqs[a].add_(ds @ ks[b], alpha=scale)
                dks[b].add_(ds.transpose(-2, -1) @ qs[a], alpha=scale)
            if cp > 1:   # the accumulated dK/dV follow their block; after cp hops they are home
                grads_pending, dkv = _shift(g, dkv)
                grads_pending.wait()
        return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, group=None, *,
                   balanced: bool = True) -> torch.Tensor:
    """Drop-in for refimpl.model.attention on this rank's slice of the sequence."""
    b, s, width = q.shape
    hd = width // n_heads
    q, k, v = (t.view(b, s, n_heads, hd).transpose(1, 2) for t in (q, k, v))
    out = RingAttention.apply(q, k, v, group, balanced)
    return out.transpose(1, 2).reshape(b, s, width)

