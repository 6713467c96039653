"""`--set tp_overlap=true`: SP's all-gather and reduce-scatter decomposed over the ring so each
chunk's matmul runs while the next chunk travels (seed §3.3, 오버랩 가능성; Wang et al. 2022,
ASPLOS '23, §3; Megatron-LM's tp_comm_overlap), on plain isend/irecv (refimpl.comm.p2p.post).

    all-gather + matmul       step k: pass on the chunk I hold while multiplying it (t-1 steps)
    matmul + reduce-scatter   step k: multiply chunk r-k-1 while the running sum of chunk r-k
                              leaves; add the sum that arrives; rank r ends with chunk r's sum"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from refimpl.comm.p2p import GroupView, post
from refimpl.seam import phase, span


def _ring_all_gather(g: GroupView, local: torch.Tensor, on_chunk, p: str) -> None:
    """Pass `local` round the ring; on_chunk(j, chunk) for every rank j's chunk, each while the
    next one travels. `p`: "fwd" or "bwd", for the ranges' names."""
    t, r = g.size, g.rank
    here = local.contiguous()
    for k in range(t - 1):
        j = (r - k) % t
        arriving = torch.empty_like(here)
        with span("ring_all_gather", here.nbytes, g.group), phase(f"tp:ring-ag {p} c{(j - 1) % t} in"):
            posted = post(g, sends=[(here, (r + 1) % t)], recvs=[(arriving, (r - 1) % t)])
            with phase(f"tp:ring-ag {p} matmul c{j}"):
                on_chunk(j, here)
            posted.wait()
        here = arriving
    with phase(f"tp:ring-ag {p} matmul c{(r + 1) % t}"):     # the last chunk: nothing to receive
        on_chunk((r + 1) % t, here)


def _ring_reduce_scatter(g: GroupView, partial_of, p: str) -> torch.Tensor:
    """Σ over ranks of partial_of(r) on rank r: each rank computes partial_of(j) for every chunk
    j, adds the running sum that arrives, and passes it on while the next matmul runs."""
    t, r = g.size, g.rank
    with phase(f"tp:ring-rs {p} matmul c{(r - 1) % t}"):
        leaving = partial_of((r - 1) % t).contiguous()
    for k in range(1, t):
        j = (r - k - 1) % t                   # the chunk whose running sum arrives this step
        arriving = torch.empty_like(leaving)
        with span("ring_reduce_scatter", leaving.nbytes, g.group), \
                phase(f"tp:ring-rs {p} c{(j + 1) % t} out"):
            posted = post(g, sends=[(leaving, (r + 1) % t)], recvs=[(arriving, (r - 1) % t)])
            with phase(f"tp:ring-rs {p} matmul c{j}"):
                mine = partial_of(j)
            posted.wait()
        leaving = (mine + arriving).contiguous()
    return leaving                            # chunk r, summed over every rank


def _tokens(j: int, c: int) -> slice:
    return slice(j * c, (j + 1) * c)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀ·X over every token of a [b, c, ·] chunk."""
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class _GatherLinears(torch.autograd.Function):
    """Y_i = AllGather_s(X)·W_iᵀ + b_i for column layers i fed one X (Q, K, V): forward the ring
    all-gather with the matmuls inside; backward the ring reduce-scatter of Σ_i dY_i·W_i, dW_i inside."""

    @staticmethod
    def forward(ctx, x, g, *params):
        b, c, h = x.shape
        weights, biases = params[0::2], params[1::2]
        full = x.new_empty((b, g.size * c, h))
        outs = [x.new_empty((b, g.size * c, w.shape[0])) for w in weights]

        def on_chunk(j, chunk):
            full[:, _tokens(j, c)] = chunk
            for out, w, bias in zip(outs, weights, biases):
                out[:, _tokens(j, c)] = F.linear(chunk, w, bias)

        _ring_all_gather(g, x, on_chunk, "fwd")
        ctx.g, ctx.c, ctx.has_bias = g, c, [bias is not None for bias in biases]
        ctx.save_for_backward(full, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        full, *weights = ctx.saved_tensors
        weight_grads = [torch.zeros_like(w) for w in weights]

        def partial_of(j):
            x_j, dx = full[:, _tokens(j, ctx.c)], 0
            for i, (grad, w) in enumerate(zip(grads, weights)):
                g_j = grad[:, _tokens(j, ctx.c)]
                weight_grads[i] += _weight_grad(g_j, x_j)
                dx = dx + g_j @ w
            return dx

        grad_x = _ring_reduce_scatter(ctx.g, partial_of, "bwd")
        param_grads = []
        for dw, grad, has_bias in zip(weight_grads, grads, ctx.has_bias):
            param_grads += [dw, grad.sum(dim=(0, 1)) if has_bias else None]
        return (grad_x, None, *param_grads)


class _LinearScatter(torch.autograd.Function):
    """Y = ReduceScatter_s(X·Wᵀ), a row layer's partial sums: forward the ring reduce-scatter with
    each chunk's matmul inside; backward the ring all-gather of dY with dX = dY·W, dW = dYᵀ·X."""

    @staticmethod
    def forward(ctx, x, weight, g):
        c = x.shape[1] // g.size
        y = _ring_reduce_scatter(g, lambda j: F.linear(x[:, _tokens(j, c)], weight), "fwd")
        ctx.g, ctx.c = g, c
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = torch.empty_like(x), torch.zeros_like(weight)

        def on_chunk(j, g_j):
            grad_x[:, _tokens(j, ctx.c)] = g_j @ weight
            grad_w.add_(_weight_grad(g_j, x[:, _tokens(j, ctx.c)]))

        _ring_all_gather(ctx.g, grad, on_chunk, "bwd")
        return grad_x, grad_w, None


def gather_linears(x: torch.Tensor, layers, group) -> tuple:
    """The outputs of column-parallel `layers` (weight [out/t, h], optional bias) on the sequence
    all-gather of x ([b, s/t, h]), the gather decomposed under the matmuls."""
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    return _GatherLinears.apply(x, GroupView.of(group), *params)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """This rank's s/t tokens of Σ_ranks x·weightᵀ (x: [b, s, in/t]), each chunk's partial sum
    sent on while the next chunk's matmul runs."""
    g = GroupView.of(group)
    if x.shape[1] % g.size:
        raise ValueError(f"ring reduce-scatter: sequence of {x.shape[1]} does not divide by {g.size}")
    return _LinearScatter.apply(x, weight, g)
