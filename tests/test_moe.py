"""Mixture of experts: router, capacity, load-balancing losses, and expert parallelism (all-to-all)
computing exactly what the one-process MoE model computes."""

import pytest
import torch
import torch.distributed as dist

from refimpl.lab.verify.equivalence import FP64_TOLERANCE, compare_states, relative_error
from refimpl.model import GPT, GPTConfig, build_model, count_params
from refimpl.model.moe import (
    MoEMLP,
    expert_capacity,
    moe_aux_loss,
    route,
    switch_aux_loss,
    within_capacity,
)
from tests.moe_runs import BASE, CASES, runs_on, single

# Expert parallelism on 4 ranks: make test-full's (make test runs it on 2; the layout matrix runs
# ep 2 and 4 through the loop in make test)
FOUR = pytest.param(4, marks=pytest.mark.full)

# --- the router ------------------------------------------------------------------------------------

def test_ties_go_to_the_lower_expert_index():
    r = route(torch.zeros(3, 6), top_k=2)
    assert r.experts.tolist() == [[0, 1]] * 3


def test_top2_gates_are_renormalised_and_top1_gate_is_the_probability():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = logits.softmax(-1)[0]
    r2, r1 = route(logits, 2), route(logits, 1)
    assert r2.experts.tolist() == [[0, 1]] and r1.experts.tolist() == [[0]]
    assert torch.allclose(r2.gates[0], p[:2] / p[:2].sum())
    assert torch.allclose(r1.gates[0], p[:1])


def test_bias_changes_the_choice_but_not_the_gate_values():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    r = route(logits, 1, bias=torch.tensor([-1.0, 0.0, 0.0, 0.0]))
    assert r.experts.tolist() == [[1]]
    assert torch.allclose(r.gates[0], logits.softmax(-1)[0, 1:2])


# --- capacity -------------------------------------------------------------------------------------

def test_capacity_formula():
    assert expert_capacity(64, 4, 1, 1.0) == 16
    assert expert_capacity(64, 4, 2, 1.25) == 40
    assert expert_capacity(10, 4, 1, 1.0) == 3          # ceil, never floor


def test_overflow_is_first_come_first_served_after_the_earlier_ranks():
    experts = torch.tensor([0, 0, 1, 0, 1])
    assert within_capacity(experts, 2, torch.tensor([0, 0]), 2).tolist() == [1, 1, 1, 0, 1]
    # An earlier rank already put one assignment in expert 0's queue and two in expert 1's.
    assert within_capacity(experts, 2, torch.tensor([1, 2]), 2).tolist() == [1, 0, 0, 0, 0]


def test_dropped_tokens_leave_the_layer_with_zero_output_and_are_counted():
    cfg = GPTConfig(d_model=16, n_heads=2, n_experts=4, top_k=1, capacity_factor=0.25)
    torch.manual_seed(0)
    layer = MoEMLP(cfg)
    x = torch.randn(2, 32, 16)
    out = layer(x).reshape(-1, 16)
    dropped = ~layer.keep[:, 0]
    assert layer.stats.dropped == int(dropped.sum()) == 64 - 4 * layer.stats.capacity
    assert torch.all(out[dropped] == 0) and torch.all(out[~dropped].abs().sum(1) > 0)


# --- balancing ------------------------------------------------------------------------------------

def test_aux_loss_is_alpha_when_balanced_and_alpha_times_e_when_collapsed():
    uniform = torch.full((8, 4), 0.25)
    assert switch_aux_loss(uniform, torch.tensor([2, 2, 2, 2]), 0.01).item() == pytest.approx(0.01)
    collapsed = torch.zeros(8, 4)
    collapsed[:, 1] = 1.0
    assert switch_aux_loss(collapsed, torch.tensor([0, 8, 0, 0]), 0.01).item() == pytest.approx(0.04)


def test_aux_loss_reaches_the_router_and_only_when_balance_is_aux():
    for balance, expect in (("aux", True), ("none", False), ("bias", False)):
        model = build_model(GPTConfig(**{**BASE.to_dict(), "balance": balance}), seed=0)
        model(torch.zeros(2, 8, dtype=torch.long))
        aux = moe_aux_loss(model)
        assert (float(aux.detach() if torch.is_tensor(aux) else aux) > 0) == expect
        if expect:
            aux.backward()
            assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0


def test_bias_moves_against_the_load():
    layer = MoEMLP(GPTConfig(d_model=16, n_heads=2, n_experts=4, top_k=1, balance="bias",
                             bias_gamma=0.1))
    layer(torch.randn(1, 64, 16))
    load = layer.stats.routed.float()
    layer.update_bias()
    assert torch.equal(layer.expert_bias, -0.1 * torch.sign(load - load.mean()))


def test_dense_model_is_untouched_and_moe_counts_e_mlps_and_a_router():
    dense, moe = GPTConfig(), GPTConfig(n_experts=4)
    mlp = 2 * dense.mlp_ratio * dense.d_model ** 2 + dense.mlp_ratio * dense.d_model + dense.d_model
    extra = dense.n_layers * (3 * mlp + dense.d_model * 4)
    assert count_params(GPT(moe)) - count_params(GPT(dense)) == extra


# --- expert parallelism -----------------------------------------------------------------------------

def _merged(per_rank: list[dict], key: str) -> dict:
    merged = {}
    for r in per_rank:
        merged.update(r[key])
    return merged


@pytest.mark.ranks
@pytest.mark.parametrize("world", [2, FOUR])
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_equals_one_process(world, name):
    per_rank, ref = [r[name] for r in runs_on(world)], single(name)
    losses = per_rank[0]["losses"]
    assert max(abs(a - b) / b for a, b in zip(losses, ref["losses"])) <= FP64_TOLERANCE
    grads = _merged(per_rank, "grads")       # every rank: replicated grads + its experts' grads
    assert grads.keys() == ref["grads"].keys()
    for n, g in ref["grads"].items():
        assert relative_error(grads[n], g) <= FP64_TOLERANCE or (
            g.abs().max() < 1e-15 and grads[n].abs().max() < 1e-15), n
    weight_err, _, _ = compare_states(per_rank[0]["state"], ref["state"])
    assert weight_err <= FP64_TOLERANCE


@pytest.mark.ranks
@pytest.mark.parametrize("world", [2, FOUR])
@pytest.mark.parametrize("name", ["top1-tight", "top2-tight-bias"])
def test_tight_capacity_drops_the_same_tokens(world, name):
    per_rank, ref = [r[name] for r in runs_on(world)], single(name)
    for step in range(len(ref["keep"])):
        for layer, want in enumerate(ref["keep"][step]):
            got = torch.cat([r["keep"][step][layer] for r in per_rank])
            assert torch.equal(got, want)
        assert per_rank[0]["dropped"][step] == ref["dropped"][step]
    assert sum(map(sum, ref["dropped"])) > 0


@pytest.mark.ranks
@pytest.mark.parametrize("world", [2, FOUR])
def test_an_expert_with_no_tokens_has_zero_gradients(world):
    per_rank, ref = [r["expert3-starved"] for r in runs_on(world)], single("expert3-starved")
    grads = _merged(per_rank, "grads")
    for n in ref["grads"]:
        if ".experts.3." in n:
            assert torch.count_nonzero(grads[n]) == 0 and torch.count_nonzero(ref["grads"][n]) == 0
    owner = per_rank[-1]                       # the last rank holds expert 3
    assert all(int(layer[:, -1].sum()) == 0 for step in owner["received"] for layer in step)


@pytest.mark.ranks
def test_bytes_counted_are_the_rows_sent_to_other_ranks():
    world = 2
    per_rank = [r["refimpl-comm"] for r in runs_on(world)]
    d = BASE.d_model
    for rank, r in enumerate(per_rank):
        # refimpl.comm counted every byte it sent; the MoE layer counted its own all-to-alls:
        # the whole fixed-size buffers (padding included), the same every step (shapes only).
        wire = [b["sent"] for b in r["bytes"]]
        assert r["counted"]["sent"]["all_to_all"] == sum(wire) + _count_bytes(r, world)
        routed = [b["routed_dispatch"] + b["routed_combine"] for b in r["bytes"]]
        assert len(set(wire)) == 1 and wire[0] > routed[0]
        assert [b["padding"] for b in r["bytes"]] == [w - x for w, x in zip(wire, routed)]
    # Every row a rank dispatches to a remote expert comes back to it in the combine (forward),
    # and backward sends both again, reversed: over the ranks, dispatch bytes = combine bytes.
    for step in range(len(per_rank[0]["bytes"])):
        sent = [r["bytes"][step] for r in per_rank]
        assert sum(b["routed_dispatch"] for b in sent) == sum(b["routed_combine"] for b in sent) > 0
        # A rank's combine returns what its experts got from the other rank; its dispatch sends
        # what the other rank's experts got from it: rows x d x 8 bytes (float64), forward and
        # backward.
        for rank, b in enumerate(sent):
            other = 1 - rank
            got = sum(int(layer[other].sum()) for layer in per_rank[rank]["received"][step])
            gave = sum(int(layer[rank].sum()) for layer in per_rank[other]["received"][step])
            assert (b["routed_combine"], b["routed_dispatch"]) == (2 * got * d * 8, 2 * gave * d * 8)


def _count_bytes(r: dict, world: int) -> int:
    # The int64 count exchange: E counts, of which E - E/world go to the other ranks, per layer.
    e = BASE.n_experts
    return len(r["bytes"]) * BASE.n_layers * (e - e // world) * 8


@pytest.mark.ranks
def test_experts_must_divide_over_ep():
    from refimpl import launch

    with pytest.raises(launch.RankFailedError, match="do not divide"):
        launch.run(_parallelize_three_experts, 2, quiet=True, timeout=120)


def _parallelize_three_experts(rank, world):
    from refimpl.parallel.ep.dispatch import parallelize_experts

    group = dist.new_group(list(range(world)))
    parallelize_experts(build_model(GPTConfig(d_model=16, n_heads=2, n_experts=3), 0), group)


# --- parameters vs FLOPs ------------------------------------------------------------------------------

@pytest.mark.parametrize("experts,k,tie", [(8, 2, False), (4, 1, True)])
def test_moe_has_e_over_k_mlps_of_parameters_for_the_flops_of_its_dense_twin(experts, k, tie):
    from refimpl.lab.predict.moe_arithmetic import dense_twin, gpt_counts, measured_forward_flops

    # capacity factor 1: the experts' fixed buffers hold E * C = k * T rows (refimpl.model.moe_slots)
    cfg = GPTConfig(n_experts=experts, top_k=k, capacity_factor=1.0, tie_embeddings=tie)
    idx = torch.zeros(2, 32, dtype=torch.long)
    for c in (cfg, dense_twin(cfg)):
        model, formula = GPT(c), gpt_counts(c, context=32)
        assert count_params(model) == formula.total_params
        assert measured_forward_flops(model, idx) == 64 * formula.forward_flops_per_token
    # a capacity factor of 2 doubles the experts' rows, padding included: their FLOPs double
    padded = GPT(GPTConfig(**{**cfg.to_dict(), "capacity_factor": 2.0}))
    expert_flops = 64 * cfg.n_layers * k * 2 * 2 * cfg.d_model * cfg.mlp_ratio * cfg.d_model
    assert measured_forward_flops(padded, idx) == 64 * gpt_counts(cfg, 32).forward_flops_per_token + expert_flops
    moe, dense = gpt_counts(cfg, 32), gpt_counts(dense_twin(cfg), 32)
    # Same compute per token (up to the d x E router) for several times the parameters.
    router_flops = 2 * cfg.n_layers * cfg.d_model * experts
    assert moe.forward_flops_per_token - dense.forward_flops_per_token == router_flops
    assert moe.total_params / dense.total_params > 1.5


@pytest.mark.parametrize("name,total_tol,active_tol", [("Mixtral 8x7B", 0.005, 0.005),
                                                       ("DeepSeek-V3", 0.005, 0.02)])
def test_published_moe_sizes_from_their_configs(name, total_tol, active_tol):
    from refimpl.lab.predict.moe_arithmetic import PUBLISHED

    fn, total, active = PUBLISHED[name]
    c = fn()
    assert abs(c.total_params / total - 1) <= total_tol
    assert abs(c.active_params / active - 1) <= active_tol


@pytest.mark.parametrize("changes,ep,words", [
    (dict(n_experts=6), 4, "divisible by ep"), (dict(n_experts=4, top_k=5), 1, "--top-k"),
    (dict(n_experts=4, capacity_factor=0.0), 1, "--capacity-factor"),
    (dict(n_experts=4, balance="loss"), 1, "balance"), (dict(), 2, "needs --experts")])
def test_bad_moe_layouts_are_one_line_layout_errors(changes, ep, words):
    from refimpl.lab.layout_rules import check_moe
    from refimpl.mesh import LayoutError

    with pytest.raises(LayoutError, match=words) as e:
        check_moe(GPTConfig(**changes), ep=ep)
    assert "\n" not in str(e.value)


def test_ep_traffic_row_four_all_to_alls_per_layer_of_k_t_rows():
    from refimpl.lab.predict.strategy_cost import ep_traffic

    row = ep_traffic(tokens_per_rank=100, hidden=8, n_layers=3, top_k=2, ep=4, bytes_per_value=4)
    (op, message, calls), = row["calls"]
    assert (op, message, calls) == ("all_to_all", 2 * 100 * 8 * 4, 12)
    assert row["sent_per_rank"] == 12 * message * 3 / 4      # (ep-1)/ep of the rows leave the rank


def test_ep_buffer_bytes_whole_buffers_of_min_c_t_rows_per_expert():
    from refimpl.lab.predict.strategy_cost import ep_buffer_bytes

    # 2 ranks of 100 tokens, E = 4, k = 2, cf = 2: C = ceil(2*200/4*2) = 200, B = min(200, 100)
    got = ep_buffer_bytes(100, 2, 4, 2, 2.0, hidden=8, n_layers=3, ep=2, bytes_per_value=4)
    assert (got["capacity"], got["rows per expert (B)"], got["buffer rows"]) == (200, 100, 400)
    assert got["sent_per_rank"] == 12 * 200 * 8 * 4          # half of 400 rows leave, 12 calls
    # cf = 0.5: C = 50 < T_rank, B = C
    assert ep_buffer_bytes(100, 2, 4, 2, 0.5, 8, 3, 2)["rows per expert (B)"] == 50
