"""Tensor parallelism (seed §3.3; Megatron-LM, Shoeybi et al. 2019, §3): layers split across ranks.

A linear layer Y = X·Aᵀ (PyTorch stores A as [out, in]) can be split two ways over t ranks:

  column parallel (열 병렬화)  A's output rows split: rank r computes Y_r = X·A_rᵀ, its slice of Y's
                               last dim. X must be on every rank; its gradient is a *sum* over ranks
                               (each Y_r depends on all of X): the all-reduce in backward.
  row parallel (행 병렬화)     A's input columns split: rank r computes X_r·A_rᵀ from its slice of X,
                               a partial sum; Y = Σ_r X_r·A_rᵀ: the all-reduce in forward.

Column then row (the FFN's A then B, attention's W_Q/W_K/W_V then W_O) needs no communication in
between: the column layer's output slice is exactly the row layer's input slice, and GELU, softmax
per head, etc. act elementwise or per head. So a block costs one all-reduce per pass per sub-layer:
2 in forward, 2 in backward (the lecture's point: two layers, one communication each way).

Sequence parallelism (Korthikanti et al. 2022, §4.2.2): the all-reduce is a reduce-scatter followed
by an all-gather, so split it around the region between blocks. After the row layer, reduce-scatter
along the sequence; LayerNorm (and dropout, which this model does not have) then run on s/t tokens;
before the next column layer, all-gather them. Same bytes on the wire, 1/t of the LayerNorm work and
of its activations.

Every parallel layer here is built from a full nn.Linear by slicing (`from_linear`), so a TP model
starts from exactly the reference weights. `group=None` means one rank: the layer is the full one.
`comm` (default torch.distributed; refimpl.comm under --collectives refimpl) issues the collectives.
The shared building blocks live in refimpl.parallel.tp.mappings; the whole-model transform,
vocabulary parallelism and state-dict gathering in tp/parallelize.py and tp/vocab.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from refimpl.cost.tp_comm import kv_heads_per_rank
from refimpl.labels import phase
from refimpl.model import attention
from refimpl.model.gqa import GroupedQueryAttention, grouped_attention
from refimpl.model.swiglu import SwiGLU
from refimpl.parallel.tp.mappings import (
    all_reduce_grad_logged,
    copy_to_region,
    gather_from_sequence,
    gather_last_dim,
    group_rank,
    group_size,
    mark_sequence_partial,
    reduce_from_region,
    scatter_to_sequence,
    split_last_dim,
)
from refimpl.parallel.tp.overlap import gather_linears, linear_reduce_scatter
from refimpl.placement import Shard, set_placement


def default_group(group):
    """`group=None` is the default (world) group, as everywhere in torch.distributed; only in a
    process with no process group at all does None mean one rank (nothing split)."""
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def _rows(full: torch.Tensor, group, pad_to_multiple: bool) -> torch.Tensor:
    """This rank's slice of dim 0 (zero-padded to a multiple of t when allowed)."""
    t, r = group_size(group), group_rank(group)
    n = full.shape[0]
    if n % t:
        if not pad_to_multiple:
            raise ValueError(f"dim of size {n} does not divide by tensor-parallel size {t}")
        padded = -(-n // t) * t
        full = torch.cat([full, full.new_zeros((padded - n,) + full.shape[1:])])
    return full.chunk(t, dim=0)[r].clone()


class ColumnParallelLinear(nn.Module):
    """Y_r = X·A_rᵀ + b_r: this rank's out_features/t outputs.

    Input: `copy_to_region` (f) makes X's gradient the sum over ranks; under sequence parallelism
    `gather_from_sequence` all-gathers X's tokens instead (backward: reduce-scatter). When a caller
    feeds several column layers the same X (attention's Q, K, V), it enters the region once and
    builds these with `input_in_region=True`, so the backward pays one all-reduce, not three.
    Output: this rank's slice, or, with gather_output, the full Y (all-gather on the last dim).
    An out_features that t does not divide (a vocabulary) is zero-padded; the padded outputs
    must be ignored downstream (the vocabulary-parallel loss masks them; gather_output trims them).
    """

    # Zero bubble's deferred W (refimpl.parallel.pp.zero_bubble) needs the matmul's own input and
    # output, which sequence parallelism's gather / reduce-scatter hide from a forward hook: while
    # it records a micro-batch it sets this to a callable(module, x, y); None otherwise.
    observe_matmul = None


    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, *, out_full: int,
                 gather_output: bool, sequence_parallel: bool, input_in_region: bool, comm=None,
                 overlap: bool = False):
        super().__init__()
        self.group, self.out_full, self.comm = group, out_full, comm or dist
        # --set tp_overlap=true: the SP all-gather decomposed under the matmul (tp/overlap.py)
        self.overlap = overlap and sequence_parallel and group_size(group) > 1
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.input_in_region = input_in_region
        self.out_local = weight.shape[0]
        self.out_start = group_rank(group) * self.out_local    # first output index this rank holds
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        set_placement(self.weight, Shard("tp", 0, out_full))
        if self.bias is not None:
            set_placement(self.bias, Shard("tp", 0, out_full))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, gather_output: bool = False, *,
                    sequence_parallel: bool = False, input_in_region: bool = False,
                    pad: bool = False, comm=None, overlap: bool = False) -> "ColumnParallelLinear":
        group = default_group(group)
        w = _rows(linear.weight.detach(), group, pad)
        b = _rows(linear.bias.detach(), group, pad) if linear.bias is not None else None
        return cls(w, b, group, out_full=linear.out_features, gather_output=gather_output,
                   sequence_parallel=sequence_parallel, input_in_region=input_in_region, comm=comm,
                   overlap=overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap and not self.input_in_region:
            (y,) = gather_linears(x, [self], self.group)
        else:
            if not self.input_in_region:
                x = enter_region(x, self.group, self.sequence_parallel, self.comm)
            y = F.linear(x, self.weight, self.bias)
        if self.observe_matmul is not None:   # never under overlap (tp_overlap refuses --pp)
            self.observe_matmul(self, x, y)
        if self.gather_output:
            y = gather_last_dim(y, self.group, self.comm)[..., :self.out_full]
        return y


class RowParallelLinear(nn.Module):
    """Y = Σ_r X_r·A_rᵀ + b: partial sums reduced over ranks, then the (replicated) bias once.

    With input_is_parallel (the usual case, after a column layer) X_r is already this rank's slice
    of the last dim; otherwise X is full and `split_last_dim` takes the slice (backward: all-gather).
    The reduction is `reduce_from_region` (g: all-reduce), or under sequence parallelism
    `scatter_to_sequence` (reduce-scatter: each rank keeps s/t tokens of the sum).
    """

    # Zero bubble's deferred W (refimpl.parallel.pp.zero_bubble) needs the matmul's own input and
    # output, which sequence parallelism's gather / reduce-scatter hide from a forward hook: while
    # it records a micro-batch it sets this to a callable(module, x, y); None otherwise.
    observe_matmul = None


    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group, *,
                 input_is_parallel: bool, sequence_parallel: bool, comm=None, overlap: bool = False):
        super().__init__()
        self.group, self.input_is_parallel, self.comm = group, input_is_parallel, comm or dist
        self.sequence_parallel = sequence_parallel
        # --set tp_overlap=true: the SP reduce-scatter decomposed under the matmul (tp/overlap.py)
        self.overlap = overlap and sequence_parallel and group_size(group) > 1
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        set_placement(self.weight, Shard("tp", 1, weight.shape[1] * group_size(group)))
        if self.bias is not None and sequence_parallel:
            # Added after the reduction, so every rank holds all of it (replicated); under sequence
            # parallelism each rank adds it to its own tokens only: its gradient is partial over s.
            mark_sequence_partial(self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True, *,
                    sequence_parallel: bool = False, comm=None,
                    overlap: bool = False) -> "RowParallelLinear":
        group = default_group(group)
        w = _rows(linear.weight.detach().t(), group, pad_to_multiple=False).t().contiguous()
        b = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(w, b, group, input_is_parallel=input_is_parallel,
                   sequence_parallel=sequence_parallel, comm=comm, overlap=overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_last_dim(x, self.group, self.comm)
        if self.overlap:
            y = linear_reduce_scatter(x, self.weight, self.group)
            return y + self.bias if self.bias is not None else y
        partial = F.linear(x, self.weight)
        if self.observe_matmul is not None:
            self.observe_matmul(self, x, partial)
        y = exit_region(partial, self.group, self.sequence_parallel, self.comm)
        return y + self.bias if self.bias is not None else y


def enter_region(x: torch.Tensor, group, sequence_parallel: bool, comm=dist) -> torch.Tensor:
    """Before column-parallel layers: f (copy) or, under SP, all-gather the sequence."""
    if sequence_parallel:
        return gather_from_sequence(x, group, comm)
    return copy_to_region(x, group, comm)


def column_outputs(x: torch.Tensor, layers, group, sequence_parallel: bool, comm=dist,
                   overlap: bool = False) -> tuple:
    """Column-parallel `layers` (built input_in_region) fed one X that enters the region once:
    Q, K, V or SwiGLU's gate and up. With overlap (SP only), the all-gather is decomposed under
    their matmuls, all of them per chunk (tp/overlap.py)."""
    if overlap and sequence_parallel and group_size(group) > 1:
        return gather_linears(x, layers, group)
    x = enter_region(x, group, sequence_parallel, comm)
    return tuple(layer(x) for layer in layers)


def exit_region(x: torch.Tensor, group, sequence_parallel: bool, comm=dist) -> torch.Tensor:
    """After a row-parallel layer: g (all-reduce) or, under SP, reduce-scatter the sequence."""
    if sequence_parallel:
        return scatter_to_sequence(x, group, comm)
    return reduce_from_region(x, group, comm)


class ParallelMLP(nn.Module):
    """Y = GELU(X·A)·B with A column-parallel and B row-parallel (seed §3.3, FFN 블록): rank r
    computes GELU(X·A_r)·B_r locally; one reduction at the end (forward), one at X (backward)."""

    def __init__(self, up: ColumnParallelLinear, down: RowParallelLinear):
        super().__init__()
        self.up, self.down = up, down
        self.label = "tp:mlp"          # a profiler range; parallelize_tp names the block

    @classmethod
    def from_mlp(cls, mlp: nn.Module, group=None, sequence_parallel: bool = False,
                 comm=None, overlap: bool = False) -> "ParallelMLP":
        sp, ov = sequence_parallel, overlap
        return cls(ColumnParallelLinear.from_linear(mlp.up, group, sequence_parallel=sp, comm=comm,
                                                    overlap=ov),
                   RowParallelLinear.from_linear(mlp.down, group, sequence_parallel=sp, comm=comm,
                                                 overlap=ov))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with phase(self.label):
            return self.down(F.gelu(self.up(x)))


class ParallelSelfAttention(nn.Module):
    """Attention split by heads (seed §3.3, 어텐션 블록): W_Q, W_K, W_V column-parallel so rank r
    holds heads [r·a/t, (r+1)·a/t) whole; scores, softmax and S·V are per head, so they run locally
    (`refimpl.model.attention` on a/t heads) with no communication; W_O is row-parallel.

    The input enters the region once for Q, K and V together (Megatron fuses them into one QKV
    matrix for the same reason): one all-reduce (or reduce-scatter under SP) of X's gradient.
    """

    def __init__(self, q, k, v, o, n_heads_local: int, group, sequence_parallel: bool, comm=None,
                 overlap: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.o = q, k, v, o
        self.n_heads = n_heads_local
        self.group, self.sequence_parallel, self.comm = group, sequence_parallel, comm or dist
        self.overlap = overlap
        self.label = "tp:attn"         # a profiler range; parallelize_tp names the block

    @classmethod
    def from_attention(cls, attn: nn.Module, group=None,
                       sequence_parallel: bool = False, comm=None,
                       overlap: bool = False) -> "ParallelSelfAttention":
        t = group_size(group)
        if attn.n_heads % t:
            raise ValueError(f"{attn.n_heads} heads do not divide by tensor-parallel size {t}")
        # Heads are contiguous blocks of head_dim rows in W_Q/W_K/W_V, so slicing rows by t keeps
        # whole heads together: rank r's rows are exactly heads r·a/t ... (r+1)·a/t - 1.
        q, k, v = (ColumnParallelLinear.from_linear(lin, group, input_in_region=True, comm=comm)
                   for lin in (attn.q, attn.k, attn.v))
        o = RowParallelLinear.from_linear(attn.o, group, sequence_parallel=sequence_parallel,
                                          comm=comm, overlap=overlap)
        return cls(q, k, v, o, attn.n_heads // t, group, sequence_parallel, comm, overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with phase(self.label):
            q, k, v = column_outputs(x, (self.q, self.k, self.v), self.group,
                                     self.sequence_parallel, self.comm, self.overlap)
            return self.o(attention(q, k, v, self.n_heads))


class ParallelSwiGLU(nn.Module):
    """Y = (SiLU(X·W_gate) ⊙ X·W_up)·W_down (Llama's MLP, Mixtral's experts): W_gate and W_up
    column-parallel, so rank r holds the same w/t channels of both and the product ⊙ is local;
    W_down row-parallel. X enters the region once for the two column layers (one all-reduce of
    its gradient, as attention's Q, K, V)."""

    def __init__(self, gate: ColumnParallelLinear, up: ColumnParallelLinear,
                 down: RowParallelLinear, group, sequence_parallel: bool, comm=None,
                 overlap: bool = False):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.group, self.sequence_parallel, self.comm = group, sequence_parallel, comm or dist
        self.overlap = overlap
        self.label = "tp:mlp"

    @classmethod
    def from_swiglu(cls, mlp: SwiGLU, group=None, sequence_parallel: bool = False,
                    comm=None, overlap: bool = False) -> "ParallelSwiGLU":
        gate, up = (ColumnParallelLinear.from_linear(lin, group, input_in_region=True, comm=comm)
                    for lin in (mlp.gate, mlp.up))
        down = RowParallelLinear.from_linear(mlp.down, group, sequence_parallel=sequence_parallel,
                                             comm=comm, overlap=overlap)
        return cls(gate, up, down, default_group(group), sequence_parallel, comm, overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with phase(self.label):
            gate, up = column_outputs(x, (self.gate, self.up), self.group, self.sequence_parallel,
                                      self.comm, self.overlap)
            return self.down(F.silu(gate) * up)


def parallel_feed_forward(mlp: nn.Module, group=None, sequence_parallel: bool = False,
                          comm=None, overlap: bool = False) -> nn.Module:
    """The tensor-parallel form of a dense feed-forward layer (GELU MLP or SwiGLU)."""
    if isinstance(mlp, SwiGLU):
        return ParallelSwiGLU.from_swiglu(mlp, group, sequence_parallel, comm, overlap)
    return ParallelMLP.from_mlp(mlp, group, sequence_parallel, comm, overlap)


def _shared_kv(linear: nn.Linear, group, repeats: int, comm) -> ColumnParallelLinear:
    """K or V when fewer heads than ranks: this rank's one head (head r // repeats), whose
    gradient each of its `repeats` ranks computes from its own query heads only: the true one
    is their sum, taken in backward over the tp group (the other heads' rows zero)."""
    t, r = group_size(group), group_rank(group)
    head_rows = linear.out_features // (t // repeats)
    head = r // repeats
    weight = linear.weight.detach()[head * head_rows:(head + 1) * head_rows].clone()
    layer = ColumnParallelLinear(weight, None, group, out_full=linear.out_features,
                                 gather_output=False, sequence_parallel=False,
                                 input_in_region=True, comm=comm)
    set_placement(layer.weight, Shard("tp", 0, linear.out_features, repeats=repeats))

    def sum_over_sharers(grad: torch.Tensor) -> torch.Tensor:
        rows = grad.new_zeros((linear.out_features, grad.shape[1]))
        rows[head * head_rows:(head + 1) * head_rows] = grad
        summed = all_reduce_grad_logged(rows, group, comm or dist)
        return summed[head * head_rows:(head + 1) * head_rows]

    layer.weight.register_hook(sum_over_sharers)
    return layer


class ParallelGroupedAttention(nn.Module):
    """Grouped-query attention split by heads (refimpl.model.gqa): W_Q column-parallel (a/t query
    heads each), W_K and W_V by key/value heads when t divides them, each rank's one shared head
    otherwise (`kv_heads_per_rank`); W_O row-parallel. Rank r's query heads read only the key/value heads
    it holds: query heads are grouped consecutively, so the first a/t of them read the first
    kv/t key/value heads, or head r // (t/kv) when t/kv ranks share it."""

    def __init__(self, q, k, v, o, n_heads_local: int, n_kv_local: int, theta: float, group,
                 sequence_parallel: bool, comm=None, overlap: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.o = q, k, v, o
        self.n_heads, self.n_kv_heads, self.theta = n_heads_local, n_kv_local, theta
        self.group, self.sequence_parallel, self.comm = group, sequence_parallel, comm or dist
        self.overlap = overlap
        self.label = "tp:attn"

    @classmethod
    def from_attention(cls, attn: nn.Module, group=None, sequence_parallel: bool = False,
                       comm=None, overlap: bool = False) -> "ParallelGroupedAttention":
        group = default_group(group)
        t = group_size(group)
        if attn.n_heads % t:
            raise ValueError(f"{attn.n_heads} heads do not divide by tensor-parallel size {t}")
        # Megatron's replication of K/V heads when tp exceeds them (refimpl.cost.tp_comm)
        kv_local, repeats = kv_heads_per_rank(attn.n_kv_heads, t)
        q = ColumnParallelLinear.from_linear(attn.q, group, input_in_region=True, comm=comm)
        if repeats == 1:
            k, v = (ColumnParallelLinear.from_linear(lin, group, input_in_region=True, comm=comm)
                    for lin in (attn.k, attn.v))
        else:
            k, v = (_shared_kv(lin, group, repeats, comm) for lin in (attn.k, attn.v))
        o = RowParallelLinear.from_linear(attn.o, group, sequence_parallel=sequence_parallel,
                                          comm=comm, overlap=overlap)
        return cls(q, k, v, o, attn.n_heads // t, kv_local, attn.theta, group,
                   sequence_parallel, comm, overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with phase(self.label):
            q, k, v = column_outputs(x, (self.q, self.k, self.v), self.group,
                                     self.sequence_parallel, self.comm, self.overlap)
            positions = torch.arange(q.shape[1], device=x.device)   # every token, once gathered
            return self.o(grouped_attention(q, k, v, self.n_heads, self.n_kv_heads, positions,
                                            self.theta))


def parallel_attention(attn: nn.Module, group=None, sequence_parallel: bool = False,
                       comm=None, overlap: bool = False) -> nn.Module:
    """The tensor-parallel form of a block's attention (multi-head or grouped-query)."""
    if isinstance(attn, GroupedQueryAttention):
        return ParallelGroupedAttention.from_attention(attn, group, sequence_parallel, comm, overlap)
    return ParallelSelfAttention.from_attention(attn, group, sequence_parallel, comm, overlap)
