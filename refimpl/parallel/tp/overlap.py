"""`--set tp_overlap=true`: sequence parallelism's collectives decomposed over the ring, so that each
chunk's matmul runs while the next chunk travels (seed §3.3, 오버랩 가능성).

Under sequence parallelism (Korthikanti et al. 2022, §4.2.2) a column-parallel layer all-gathers its
s/t-token input before the matmul, and a row-parallel layer reduce-scatters its output after it.
Either collective is t-1 ring steps, and a step's chunk is all one matmul needs:

  all-gather + matmul (column layer's forward; a row layer's backward)
      step k: send the chunk I hold to the next rank and receive the one before me, *while* the
              matmul of the chunk I hold runs; after t-1 steps every chunk has been multiplied.
  matmul + reduce-scatter (row layer's forward; a column layer's backward)
      step k: multiply chunk j_k = r-k-1 (mod t) while the running sum of chunk r-k goes on to the
              next rank; add the sum that arrives for chunk j_k; after t-1 steps rank r holds the
              full sum of its own chunk r.

The backward of one is the other (Megatron's f/g idea, here with the matmul inside), so two
autograd Functions cover forward and backward; each also computes its weight's gradient chunk by
chunk inside the same ring, more compute under the same messages. This is the decomposition of
Wang et al. 2022 ("Overlap communication with dependent computation via decomposition in large deep
learning models", ASPLOS '23, §3), Megatron-LM's `tp_comm_overlap` (there on userbuffers) and
PyTorch's async TP (torch.distributed._symmetric_memory, CUDA only); here it is written with plain
isend/irecv (refimpl.comm.p2p.post) so it runs under gloo too.

NCCL's rules: every step posts one send to the next rank and one receive from the previous one, in
that order, on every rank (as one batch under NCCL: a 2-rank ring's peers are each other); every
buffer is contiguous and made on the input's device.

Profiler ranges, per step (what the trace test and notebook 06 read):
    tp:ring-ag <fwd|bwd> c<j> in          chunk j arriving here, around the matmul below
      tp:ring-ag <fwd|bwd> matmul c<i>    the matmul of the chunk already here
    tp:ring-rs <fwd|bwd> c<j> out         the running sum of chunk j leaving, around the matmul below
      tp:ring-rs <fwd|bwd> matmul c<i>    the next chunk's matmul
Each step is also one `comm:ring_all_gather` / `comm:ring_reduce_scatter` call of one chunk's bytes
in the open CommLogs (refimpl.labels), so a trace's comm ranges cover the matmuls they hide.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from refimpl.comm.p2p import GroupView, post
from refimpl.labels import comm_span, open_logs, phase


def _ring_all_gather(g: GroupView, local: torch.Tensor, on_chunk, pass_: str, logs) -> None:
    """Pass `local` (this rank's chunk) round the ring; call on_chunk(j, chunk) for every rank j's
    chunk, each while the next one travels."""
    t, r = g.size, g.rank
    nxt, prv = (r + 1) % t, (r - 1) % t
    p = "fwd" if pass_ == "forward" else "bwd"
    here = local.contiguous()
    for k in range(t):
        j = (r - k) % t
        if k == t - 1:                        # the last chunk: nothing left to receive
            with phase(f"tp:ring-ag {p} matmul c{j}"):
                on_chunk(j, here)
            break
        arriving = torch.empty_like(here)
        with comm_span("ring_all_gather", here.nbytes, world=t, pass_=pass_, logs=logs,
                       group=g.group), phase(f"tp:ring-ag {p} c{(j - 1) % t} in"):
            posted = post(g, sends=[(here, nxt)], recvs=[(arriving, prv)])
            with phase(f"tp:ring-ag {p} matmul c{j}"):
                on_chunk(j, here)
            posted.wait()
        here = arriving


def _ring_reduce_scatter(g: GroupView, partial_of, pass_: str, logs) -> torch.Tensor:
    """Σ over ranks of partial_of(r) on rank r: every rank computes partial_of(j) for each chunk j,
    adding the running sum that arrives, and passes it on while the next chunk's matmul runs."""
    t, r = g.size, g.rank
    nxt, prv = (r + 1) % t, (r - 1) % t
    p = "fwd" if pass_ == "forward" else "bwd"
    j = (r - 1) % t
    with phase(f"tp:ring-rs {p} matmul c{j}"):
        leaving = partial_of(j).contiguous()
    for k in range(1, t):
        j = (r - k - 1) % t                   # the chunk whose running sum arrives this step
        arriving = torch.empty_like(leaving)
        with comm_span("ring_reduce_scatter", leaving.nbytes, world=t, pass_=pass_, logs=logs,
                       group=g.group), phase(f"tp:ring-rs {p} c{(j + 1) % t} out"):
            posted = post(g, sends=[(leaving, nxt)], recvs=[(arriving, prv)])
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
    """Y_i = AllGather_s(X)·W_iᵀ + b_i for each column-parallel layer i fed the same X (Q, K, V):
    forward the ring all-gather with the matmuls inside, backward the ring reduce-scatter of
    Σ_i dY_i·W_i with dW_i inside."""

    @staticmethod
    def forward(ctx, x, g, logs, *params):
        b, c, _ = x.shape
        t = g.size
        weights, biases = params[0::2], params[1::2]
        full = x.new_empty((b, t * c, x.shape[-1]))
        outs = [x.new_empty((b, t * c, w.shape[0])) for w in weights]

        def on_chunk(j, chunk):
            full[:, _tokens(j, c)] = chunk
            for out, w, bias in zip(outs, weights, biases):
                out[:, _tokens(j, c)] = F.linear(chunk, w, bias)

        _ring_all_gather(g, x, on_chunk, "forward", logs)
        ctx.g, ctx.logs, ctx.c, ctx.has_bias = g, logs, c, [bias is not None for bias in biases]
        ctx.save_for_backward(full, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        full, *weights = ctx.saved_tensors
        c = ctx.c
        weight_grads = [torch.zeros_like(w) for w in weights]

        def partial_of(j):
            tokens = _tokens(j, c)
            x_j = full[:, tokens]
            dx = None
            for i, (grad, w) in enumerate(zip(grads, weights)):
                g_j = grad[:, tokens]
                weight_grads[i] += _weight_grad(g_j, x_j)
                dx = g_j @ w if dx is None else dx + g_j @ w
            return dx

        grad_x = _ring_reduce_scatter(ctx.g, partial_of, "backward", ctx.logs)
        param_grads = []
        for dw, grad, has_bias in zip(weight_grads, grads, ctx.has_bias):
            param_grads += [dw, grad.sum(dim=(0, 1)) if has_bias else None]
        return (grad_x, None, None, *param_grads)


class _LinearScatter(torch.autograd.Function):
    """Y = ReduceScatter_s(X·Wᵀ) (a row-parallel layer's partial sums): forward the ring
    reduce-scatter with each chunk's matmul inside, backward the ring all-gather of dY with
    dX = dY·W and dW = dYᵀ·X inside."""

    @staticmethod
    def forward(ctx, x, weight, g, logs):
        c = x.shape[1] // g.size
        y = _ring_reduce_scatter(g, lambda j: F.linear(x[:, _tokens(j, c)], weight), "forward", logs)
        ctx.g, ctx.logs, ctx.c = g, logs, c
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        c = ctx.c
        grad_x, grad_w = torch.empty_like(x), torch.zeros_like(weight)

        def on_chunk(j, g_j):
            tokens = _tokens(j, c)
            grad_x[:, tokens] = g_j @ weight
            grad_w.add_(_weight_grad(g_j, x[:, tokens]))

        _ring_all_gather(ctx.g, grad, on_chunk, "backward", ctx.logs)
        return grad_x, grad_w, None, None


def gather_linears(x: torch.Tensor, layers, group) -> tuple:
    """The outputs of column-parallel `layers` (weight [out/t, h], optional bias) on the sequence
    all-gather of x ([b, s/t, h] here), the gather decomposed under the matmuls."""
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    return _GatherLinears.apply(x, GroupView.of(group), open_logs(), *params)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """This rank's s/t tokens of Σ_ranks x·weightᵀ (x: [b, s, in/t]), each chunk's partial sum
    sent on while the next chunk's matmul runs."""
    g = GroupView.of(group)
    if x.shape[1] % g.size:
        raise ValueError(f"ring reduce-scatter: sequence of {x.shape[1]} does not divide by {g.size}")
    return _LinearScatter.apply(x, weight, g, open_logs())
