"""Attention split by heads (seed §3.3, 어텐션 블록): W_Q, W_K, W_V column-parallel, so rank r holds
heads [r·a/t, (r+1)·a/t) whole and scores, softmax and S·V run locally; W_O row-parallel.
Grouped-query attention splits K/V by their heads, or, with fewer K/V heads than ranks, gives
each rank the one its query heads read (shared by t/kv ranks, as vLLM's QKVParallelLinear).

    block.attn = parallel_attention(block.attn, group, sequence_parallel=sp)
"""
from __future__ import annotations

import torch
import torch.nn as nn

from refimpl.model import attention
from refimpl.model.gqa import GroupedQueryAttention, grouped_attention
from refimpl.parallel.tp.blocks import ColumnInputs
from refimpl.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, default_group
from refimpl.parallel.tp.mappings import all_reduce, group_rank, group_size
from refimpl.placement import Shard, set_placement


def kv_split(n_kv_heads: int, t: int) -> tuple[int, int]:
    """(K/V heads a rank holds, ranks sharing each one) for grouped-query attention over t ranks."""
    if n_kv_heads >= t:
        if n_kv_heads % t:
            raise ValueError(f"{n_kv_heads} KV heads do not split over tp = {t}")
        return n_kv_heads // t, 1
    if t % n_kv_heads:
        raise ValueError(f"tp = {t} is not a multiple of the {n_kv_heads} KV heads")
    return 1, t // n_kv_heads


def _heads(attn: nn.Module, group) -> int:
    t = group_size(group)
    if attn.n_heads % t:
        raise ValueError(f"{attn.n_heads} heads do not divide by tensor-parallel size {t}")
    return attn.n_heads // t


def _columns(linears, group) -> tuple:
    # heads are contiguous blocks of rows: slicing rows by t keeps each rank's heads whole
    return tuple(ColumnParallelLinear.from_linear(lin, group, input_in_region=True) for lin in linears)


class ParallelSelfAttention(ColumnInputs):
    """Multi-head attention on this rank's a/t heads (`refimpl.model.attention`), X entering the
    region once for Q, K and V (Megatron's fused QKV, for the same reason)."""

    def __init__(self, q, k, v, o, n_heads_local: int, group, sequence_parallel: bool):
        super().__init__()
        self.q, self.k, self.v, self.o = q, k, v, o
        self.n_heads, self.group, self.sequence_parallel = n_heads_local, group, sequence_parallel

    @classmethod
    def from_attention(cls, attn: nn.Module, group=None,
                       sequence_parallel: bool = False) -> "ParallelSelfAttention":
        group = default_group(group)
        q, k, v = _columns((attn.q, attn.k, attn.v), group)
        o = RowParallelLinear.from_linear(attn.o, group, sequence_parallel=sequence_parallel)
        return cls(q, k, v, o, _heads(attn, group), group, sequence_parallel)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, self.n_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.attend(*self.columns(x, (self.q, self.k, self.v))))


def _shared_kv(linear: nn.Linear, group, repeats: int) -> ColumnParallelLinear:
    """K or V with fewer heads than ranks: head r // repeats, its gradient summed over its sharers."""
    rows = linear.out_features // (group_size(group) // repeats)
    mine = slice(group_rank(group) // repeats * rows, (group_rank(group) // repeats + 1) * rows)
    layer = ColumnParallelLinear(linear.weight.detach()[mine].clone(), None, group,
                                 out_full=linear.out_features, input_in_region=True)
    set_placement(layer.weight, Shard("tp", 0, linear.out_features, repeats=repeats))

    def sum_over_sharers(grad: torch.Tensor) -> torch.Tensor:
        whole = grad.new_zeros((linear.out_features, grad.shape[1]))
        whole[mine] = grad
        return all_reduce(whole, group)[mine]

    layer.weight.register_hook(sum_over_sharers)
    return layer


class ParallelGroupedAttention(ParallelSelfAttention):
    """Grouped-query attention (refimpl.model.gqa) on a/t query heads and the K/V heads they read:
    query heads are grouped consecutively, so rank r's read its kv/t K/V heads, or head r // (t/kv)."""

    def __init__(self, q, k, v, o, n_heads_local: int, n_kv_local: int, theta: float, group,
                 sequence_parallel: bool):
        super().__init__(q, k, v, o, n_heads_local, group, sequence_parallel)
        self.n_kv_heads, self.theta = n_kv_local, theta

    @classmethod
    def from_attention(cls, attn: nn.Module, group=None,
                       sequence_parallel: bool = False) -> "ParallelGroupedAttention":
        group = default_group(group)
        kv_local, repeats = kv_split(attn.n_kv_heads, group_size(group))
        (q,) = _columns((attn.q,), group)
        k, v = (_columns((attn.k, attn.v), group) if repeats == 1 else
                (_shared_kv(attn.k, group, repeats), _shared_kv(attn.v, group, repeats)))
        o = RowParallelLinear.from_linear(attn.o, group, sequence_parallel=sequence_parallel)
        return cls(q, k, v, o, _heads(attn, group), kv_local, attn.theta, group, sequence_parallel)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(q.shape[1], device=q.device)   # every token, once gathered
        return grouped_attention(q, k, v, self.n_heads, self.n_kv_heads, positions, self.theta)


def parallel_attention(attn: nn.Module, group=None, sequence_parallel: bool = False) -> nn.Module:
    """The tensor-parallel form of a block's attention (multi-head or grouped-query)."""
    kind = ParallelGroupedAttention if isinstance(attn, GroupedQueryAttention) else ParallelSelfAttention
    return kind.from_attention(attn, group, sequence_parallel)
