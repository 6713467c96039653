"""Quicker shape rules on the `meta` device for the ops a dry-run step calls most.

    with fast_meta_kernels():
        strategy.train_step(batch)        # on meta tensors (refimpl.lab.verify.dryrun)

ATen's C++ meta kernels are inactive for most pointwise ops: `torch._meta_registrations` registers
Python ones over them (its `activate_meta`, the refs and decompositions torch.compile traces with),
and those cost 0.5-15 ms an op (a `logaddexp` of ring attention is a decomposition of eight prims,
each with its own Python meta) where the op itself would take microseconds. They were most of
a 70B dry run's step. Here a few of them get a shorter rule, for the one case a step meets nearly
always: its tensor arguments contiguous (the first, at least). Such an op's output is a new contiguous
tensor of the broadcast shape in the promoted dtype (TensorIterator's rule for dense inputs); a
reduction's is the reduced shape; a layer norm's its input's shape plus per-row statistics.
Anything else (a strided input, an integer dtype, an unexpected keyword) goes to torch's own
Python kernel, unchanged. Only shapes, dtypes and strides come out of a meta kernel, so a rule
agrees with torch's or it does not; tests/test_fast_meta.py compares each with torch's on the
shapes a block makes, and the dry run's figures are the same with and without them
(tests/test_dryrun.py).

The rules are registered in a Library of their own while the context is open, on top of torch's;
closing it destroys that Library, and torch's kernels are the active ones again.
"""
from __future__ import annotations

import contextlib

import torch
from torch._C import DispatchKey

aten = torch.ops.aten
META = torch.device("meta")


def _dense(*tensors) -> bool:
    return all(t.is_contiguous() and t.is_floating_point() for t in tensors)


def _broadcast(a: torch.Size, b: torch.Size) -> torch.Size:
    """NumPy's broadcasting of two shapes (torch.broadcast_shapes is Python too, and slower than
    the op it would describe: it goes through the symbolic-shape machinery)."""
    if a == b:
        return a
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise RuntimeError(f"shapes {a} and {b} cannot be broadcast together")
        out.append(x if y == 1 else y)
    return torch.Size(out)


def _new(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def pointwise(fallback, floating_only=False):
    """Binary pointwise ops with type promotion: add, sub, mul, div, logaddexp, gelu's backward;
    `b` a tensor or a Python number. The output is contiguous when every tensor operand is, or
    when the first is and already has the broadcast shape (TensorIterator takes the output's
    layout from its operands in order). The scalar keywords (alpha, approximate) change no
    shape."""
    def kernel(a, b, *rest, **kwargs):
        number = isinstance(b, (int, float)) and not isinstance(b, bool)
        if not (a.is_contiguous() and (number or isinstance(b, torch.Tensor))):
            return fallback(a, b, *rest, **kwargs)
        dtype = torch.result_type(a, b)
        if dtype == torch.bool or (floating_only and not dtype.is_floating_point):
            return fallback(a, b, *rest, **kwargs)
        shape = a.shape if number else _broadcast(a.shape, b.shape)
        if not (number or b.is_contiguous() or shape == a.shape):
            return fallback(a, b, *rest, **kwargs)
        return _new(shape, dtype)
    return kernel


def true_division(fallback):
    """div.Tensor: as `pointwise`, for a floating result only (integers divide into floats)."""
    return pointwise(fallback, floating_only=True)


def like_first(fallback):
    """Floating ops whose output is their first argument's shape and dtype (exp, gelu)."""
    def kernel(a, *rest, **kwargs):
        if not _dense(a):
            return fallback(a, *rest, **kwargs)
        return _new(a.shape, a.dtype)
    return kernel


def triangle(fallback):
    """triu and tril, of any dtype (a causal mask is bool)."""
    def kernel(a, *rest, **kwargs):
        if not a.is_contiguous():
            return fallback(a, *rest, **kwargs)
        return _new(a.shape, a.dtype)
    return kernel


def masked_fill(fallback):
    def kernel(a, mask, value):
        if not (_dense(a) and mask.is_contiguous() and mask.dtype == torch.bool):
            return fallback(a, mask, value)
        return _new(_broadcast(a.shape, mask.shape), a.dtype)
    return kernel


def softmax_backward(fallback):
    def kernel(grad, output, dim, input_dtype):
        if not _dense(grad, output) or grad.dtype != input_dtype:
            return fallback(grad, output, dim, input_dtype)
        return _new(grad.shape, input_dtype)
    return kernel


def matmul(fallback):
    """mm and bmm: a new row-major (b,) n x m, whatever the operands' strides."""
    def kernel(a, b):
        if not (a.is_floating_point() and a.dtype == b.dtype and a.dim() == b.dim()
                and a.dim() in (2, 3) and a.shape[-1] == b.shape[-2]
                and (a.dim() == 2 or a.shape[0] == b.shape[0])):
            return fallback(a, b)
        return _new(tuple(a.shape[:-1]) + (b.shape[-1],), a.dtype)
    return kernel


def reduced(fallback):
    """sum over dims (no dtype asked for) and logsumexp: the reduced shape, the input's dtype."""
    def kernel(a, dim=None, keepdim=False, **kwargs):
        if not _dense(a) or a.dim() == 0 or not dim or kwargs.get("dtype") is not None:
            return fallback(a, dim, keepdim, **kwargs)
        dims = {d % a.dim() for d in dim}
        shape = [1 if i in dims else n for i, n in enumerate(a.shape) if keepdim or i not in dims]
        return _new(shape, a.dtype)
    return kernel


def addmm(fallback):
    def kernel(bias, m1, m2, *, beta=1, alpha=1):
        # the output is a new (n, m) matrix, row-major, whatever m1's and m2's strides
        if not (bias.is_floating_point() and m1.dim() == m2.dim() == 2
                and bias.dtype == m1.dtype == m2.dtype):
            return fallback(bias, m1, m2, beta=beta, alpha=alpha)
        shape = (m1.shape[0], m2.shape[1])
        _broadcast(bias.shape, shape)      # the error torch's kernel would raise
        return _new(shape, m1.dtype)
    return kernel


def layer_norm(fallback):
    """native_layer_norm: the output like the input, and the mean and 1/std of every row (kept
    as size-1 dims), in the input's dtype for fp32 and fp64."""
    def kernel(x, normalized_shape, weight, bias, eps):
        if not (_dense(x) and x.dtype in (torch.float32, torch.float64)):
            return fallback(x, normalized_shape, weight, bias, eps)
        axis = x.dim() - len(normalized_shape)
        stats = tuple(x.shape[:axis]) + (1,) * len(normalized_shape)
        return _new(x.shape, x.dtype), _new(stats, x.dtype), _new(stats, x.dtype)
    return kernel


def layer_norm_backward(fallback):
    """The input's, weight's and bias's gradients, each where output_mask asks for it."""
    def kernel(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
        if not (_dense(grad, x) and grad.dtype == x.dtype):
            return fallback(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask)
        like = (x, weight, bias)
        return tuple(_new(t.shape, t.dtype) if wanted and t is not None else None
                     for t, wanted in zip(like, output_mask))
    return kernel


RULES = {
    aten.add.Tensor: pointwise, aten.sub.Tensor: pointwise, aten.mul.Tensor: pointwise,
    aten.div.Tensor: true_division, aten.logaddexp.default: pointwise,
    aten.gelu_backward.default: pointwise,
    aten.exp.default: like_first, aten.gelu.default: like_first, aten.triu.default: triangle,
    aten.tril.default: triangle, aten.masked_fill.Scalar: masked_fill,
    aten._softmax_backward_data.default: softmax_backward, aten.logsumexp.default: reduced,
    aten.sum.dim_IntList: reduced, aten.mm.default: matmul, aten.bmm.default: matmul,
    aten.addmm.default: addmm, aten.native_layer_norm.default: layer_norm,
    aten.native_layer_norm_backward.default: layer_norm_backward,
}


def torch_meta_kernel(op):
    """torch's own Python meta kernel of `op` (what `activate_meta` registered), or None."""
    return op.py_kernels.get(DispatchKey.Meta)


@contextlib.contextmanager
def fast_meta_kernels():
    """RULES' kernels over torch's Python meta kernels while open (each op whose kernel torch
    has as Python; one that has none keeps whatever it has)."""
    lib = torch.library.Library("aten", "IMPL", "Meta")
    try:
        for op, rule in RULES.items():
            fallback = torch_meta_kernel(op)
            if fallback is not None:
                lib.impl(op, rule(fallback))
        yield
    finally:
        lib._destroy()
