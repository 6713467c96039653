"""The dry run's shorter meta rules (refimpl.lab.verify.fast_meta) against torch's own meta kernels."""
import pytest
import torch

from refimpl.lab.verify.fast_meta import RULES, fast_meta_kernels, torch_meta_kernel

aten = torch.ops.aten


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


# (op, args, kwargs) as a transformer block's step calls them: broadcasting, 0-d operands, the
# keywords, the masks of a layer norm's backward; and cases the rules hand back to torch (a
# transposed input, integers).
x, w = meta(2, 16, 32), meta(32)
CASES = [
    (aten.add.Tensor, (x, w), {}), (aten.add.Tensor, (x, meta(2, 16, 1)), {"alpha": 2}),
    (aten.add.Tensor, (x, torch.tensor(2.0)), {}), (aten.sub.Tensor, (meta(2, 1, 16, 1), x), {}),
    (aten.mul.Tensor, (x, meta(dtype=torch.float64)), {}),
    (aten.mul.Tensor, (x.transpose(1, 2), meta(2, 32, 16)), {}),
    (aten.mul.Tensor, (meta(4, dtype=torch.int64), meta(4, dtype=torch.int64)), {}),
    (aten.mul.Tensor, (x, 2), {}), (aten.mul.Tensor, (meta(8), 3.5), {}),
    (aten.sub.Tensor, (meta(1, 4, 8, 8), meta(1, 4, 8, 2)[..., :1]), {}),
    (aten.sub.Tensor, (meta(1, 8, dtype=torch.int64), meta(8, 1, dtype=torch.int64)), {}),
    (aten.sub.Tensor, (meta(1, 8, dtype=torch.int64), 1), {}),
    (aten.add.Tensor, (meta(dtype=torch.float32), 1.0), {}),
    (aten.add.Tensor, (meta(4, dtype=torch.bool), meta(4, dtype=torch.bool)), {}),
    (aten.div.Tensor, (x, meta(2, 16, 1)), {}), (aten.div.Tensor, (meta(100), 3.0), {}),
    (aten.div.Tensor, (meta(dtype=torch.float32), 4), {}),
    (aten.div.Tensor, (meta(4, dtype=torch.int64), 2), {}), (aten.logaddexp.default, (meta(2, 4, 8, 1),) * 2, {}),
    (aten.gelu_backward.default, (x, x), {"approximate": "tanh"}),
    (aten.exp.default, (x,), {}), (aten.gelu.default, (x,), {}),
    (aten.triu.default, (meta(16, 16), 1), {}), (aten.triu.default, (meta(16, 16, dtype=torch.bool), 1), {}),
    (aten.addmm.default, (w, meta(8, 16), meta(32, 16).t()), {}), (aten.tril.default, (meta(16, 16),), {}),
    (aten.masked_fill.Scalar, (meta(2, 4, 16, 16), meta(16, 16, dtype=torch.bool), -1e9), {}),
    (aten._softmax_backward_data.default, (meta(2, 4, 16, 16),) * 2 + (-1, torch.float32), {}),
    (aten.logsumexp.default, (meta(2, 4, 16, 16), [-1], True), {}),
    (aten.logsumexp.default, (meta(2, 4, 16, 16), [1, -1], False), {}),
    (aten.sum.dim_IntList, (meta(2, 16, 32), [0, 1]), {}),
    (aten.sum.dim_IntList, (meta(2, 16, 32), [-1], True), {}),
    (aten.sum.dim_IntList, (meta(2, 16, 32), [0]), {"dtype": torch.float64}),
    (aten.mm.default, (meta(8, 16), meta(32, 16).t()), {}), (aten.mm.default, (meta(16, 8).t(), meta(16, 32)), {}),
    (aten.bmm.default, (meta(4, 8, 16), meta(4, 16, 32)), {}),
    (aten.bmm.default, (meta(4, 16, 8).transpose(1, 2), meta(4, 32, 16).transpose(1, 2)), {}),
    (aten.addmm.default, (w, meta(8, 16), meta(16, 32)), {}),
    (aten.addmm.default, (meta(8, 32), meta(8, 16), meta(16, 32)), {"beta": 0.5}),
    (aten.native_layer_norm.default, (x, [32], w, w, 1e-5), {}),
    (aten.native_layer_norm.default, (meta(2, 16, 32, dtype=torch.float64), [16, 32], None, None, 1e-5), {}),
    (aten.native_layer_norm_backward.default,
     (x, x, [32], meta(2, 16, 1), meta(2, 16, 1), w, w, [True, True, True]), {}),
    (aten.native_layer_norm_backward.default,
     (x, x, [32], meta(2, 16, 1), meta(2, 16, 1), w, None, [True, False, False]), {}),
]


def described(out):
    if isinstance(out, torch.Tensor):
        return (tuple(out.shape), out.stride(), out.dtype, out.device)
    return tuple(described(o) for o in out) if out is not None else None


@pytest.mark.parametrize("op,args,kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_rule_gives_what_torch_gives(op, args, kwargs):
    expected = described(torch_meta_kernel(op)(*args, **kwargs))
    with fast_meta_kernels():
        assert described(op(*args, **kwargs)) == expected


def test_every_rule_is_tested_and_replaces_a_python_kernel():
    assert {op for op, _, _ in CASES} == set(RULES)
    assert all(torch_meta_kernel(op) is not None for op in RULES)


def test_the_rules_are_in_force_inside_and_torch_kernels_after(monkeypatch):
    from refimpl.lab.verify import fast_meta

    made = []
    monkeypatch.setattr(fast_meta, "_new", lambda *a: made.append(a) or torch.empty(a[0], device="meta"))
    a = meta(4, 4)
    with fast_meta_kernels():
        a + a, a.exp()
    assert len(made) == 2
    a + a, a.exp()
    assert len(made) == 2


def test_shapes_that_do_not_broadcast_are_refused_as_torch_refuses_them():
    with fast_meta_kernels(), pytest.raises(RuntimeError):
        meta(4, 3) + meta(4, 2)
