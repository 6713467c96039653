"""The MoE layer's fixed-size buffers (refimpl.model.moe_slots): the same outputs and gradients as
running each expert on its kept rows only, padding that adds exact zeros, and no host read."""
import pytest
import torch

from refimpl.model import GPTConfig
from refimpl.model.moe import MoEMLP, expert_capacity, route, within_capacity
from refimpl.model.moe_slots import compact_destinations, destinations, one_hot, pack, unpack

CFG = GPTConfig(d_model=16, n_heads=2, n_experts=4, top_k=2, capacity_factor=0.75, balance="none")


def kept_rows_only(layer: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """The layer as it was before the buffers: the kept assignments picked out on the host
    (nonzero, bincount(...).tolist()), each expert run on exactly its rows."""
    tokens = x.reshape(-1, x.shape[-1])
    E, k = layer.n_experts, layer.top_k
    r = route(layer.router(tokens), k)
    flat = r.experts.reshape(-1)
    capacity = expert_capacity(tokens.shape[0], E, k, layer.cfg.capacity_factor)
    keep = within_capacity(flat, E, torch.zeros(E, dtype=torch.long), capacity)
    kept_at = keep.nonzero().squeeze(1)
    order = kept_at[torch.argsort(flat[kept_at], stable=True)]
    parts = torch.split(tokens[order // k], torch.bincount(flat[order], minlength=E).tolist())
    y = torch.cat([layer.experts[str(e)](p) for e, p in enumerate(parts)])
    weighted = y * r.gates.reshape(-1)[order][:, None]
    return tokens.new_zeros(tokens.shape).index_add(0, order // k, weighted).view(x.shape)


@pytest.mark.parametrize("factor", [0.75, 4.0])   # tokens dropped; C > T (nothing can overflow)
def test_buffers_give_the_kept_rows_outputs_and_gradients_in_float64(factor):
    cfg = GPTConfig(**{**CFG.to_dict(), "capacity_factor": factor})
    torch.manual_seed(0)
    layer = MoEMLP(cfg).double()
    x = torch.randn(2, 24, 16, dtype=torch.float64, requires_grad=True)
    runs = []
    for forward in (layer, lambda t: kept_rows_only(layer, t)):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = forward(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        runs.append((out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (out, dx, grads), (want, want_dx, want_grads) = runs
    assert torch.allclose(out, want, rtol=0, atol=1e-13) and torch.allclose(dx, want_dx, rtol=0, atol=1e-13)
    for name, g in want_grads.items():
        assert torch.allclose(grads[name], g, rtol=0, atol=1e-13), name
    if factor < 1:
        assert layer.stats.dropped > 0


def test_padding_rows_get_an_exactly_zero_output_gradient():
    """Three real rows in a 6-row expert buffer: the padded rows' outputs are not zero (the
    biases), but nothing reads them back, so their output gradient is exactly zero and the
    expert's gradients are those of the real rows alone."""
    torch.manual_seed(0)
    expert = MoEMLP(CFG).double().experts["0"]
    real = torch.randn(3, 16, dtype=torch.float64)
    dest = torch.tensor([0, 1, 2])
    grads = []
    for n_rows in (6, 3):                              # padded buffer, then the real rows only
        expert.zero_grad(set_to_none=True)
        y = expert(pack(real, dest, n_rows))
        y.retain_grad()
        out = unpack(y, dest)
        (out * torch.arange(out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in expert.named_parameters()})
        if n_rows == 6:
            assert y[3:].abs().sum() > 0 and torch.count_nonzero(y.grad[3:]) == 0
    for name, g in grads[1].items():
        assert torch.allclose(grads[0][name], g, rtol=0, atol=1e-13), name


def test_pack_and_unpack_place_rows_in_their_expert_slot():
    experts = torch.tensor([1, 0, 1, 1, 0])
    keep = torch.tensor([True, True, False, True, True])
    dest = destinations(experts, keep, one_hot(experts, 2) * keep[:, None], bound=3)
    assert dest.tolist() == [3, 0, 6, 4, 1]            # expert-major, slot = running kept count; dump = 6
    rows = torch.arange(5.0)[:, None]
    buffer = pack(rows, dest, 6)
    assert buffer.squeeze(1).tolist() == [1, 4, 0, 0, 3, 0]
    assert unpack(buffer, dest).squeeze(1).tolist() == [0, 1, 0, 3, 4]


def test_received_rows_are_compacted_source_after_source():
    recv = torch.tensor([[2, 0], [1, 3]])              # [source, local expert]: real rows
    dest = compact_destinations(recv, bound=3, room=4).view(2, 2, 3)
    dump = 2 * 4
    assert dest.tolist() == [[[0, 1, dump], [dump, dump, dump]],
                             [[2, dump, dump], [4, 5, 6]]]


def test_forward_and_backward_run_on_fake_tensors():
    """No count is read on the host: the whole layer runs where no value can be read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for scope in ("batch", "sequence"):
            layer = MoEMLP(GPTConfig(**{**CFG.to_dict(), "capacity_scope": scope, "balance": "aux"}))
            out = layer(torch.randn(2, 24, 16))
            (out.sum() + layer.aux_loss).backward()
            assert out.shape == (2, 24, 16) and layer.router.weight.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")
def test_no_stream_sync_inside_forward_and_backward_on_cuda():
    """The NCCL rule itself: on CUDA, an op that waits for the GPU to answer the host (item,
    tolist, nonzero, bincount's size) raises under sync_debug_mode 'error'."""
    for scope in ("batch", "sequence"):
        torch.manual_seed(0)
        layer = MoEMLP(GPTConfig(**{**CFG.to_dict(), "balance": "aux", "capacity_scope": scope})).cuda()
        x = torch.randn(2, 24, 16, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = layer(x)
            (out.sum() + layer.aux_loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # read after the step: every assignment routed (k * T), a gradient for the router
        assert int(layer.stats.routed.sum()) == 2 * 48 and layer.router.weight.grad is not None
