"""The helpers notebooks 06-09 assert with, checked without ranks (cheap: well under a second each)."""
from __future__ import annotations

import pytest
import torch

from refimpl.lab.measure.pp_replay import bubble_sweep, over_ideal, replay
from refimpl.lab.plan import composition
from refimpl.lab.predict import cp_comm, tp_comm
from refimpl.lab.predict.capacity_rules import displaced_first_choices, global_keep, per_group_keep
from refimpl.lab.predict.hardware import get_hardware
from refimpl.lab.predict.presets import get_model
from refimpl.model import GPTConfig


def test_one_tp_ratio_for_notebooks_06_and_09():
    shape, batch = get_model("70b")
    hw = get_hardware("h100-sxm")
    rule = composition.placement_rule(shape, hw, tp=8, pp=4, dp=2, global_batch=batch)
    tp = rule[rule.axis == "tp"].set_index("link").comm_over_compute
    layer = tp_comm.LayerShape(1, shape.seq_len, shape.d_model)
    assert tp.iloc[0] == pytest.approx(tp_comm.comm_to_compute(layer, 8, hw, within_node=True))
    assert tp.iloc[1] == pytest.approx(tp_comm.comm_to_compute(layer, 8, hw, within_node=False))
    # without overlap a ratio r adds r to the layer; full overlap leaves max(1, r)
    assert tp_comm.layer_time_over_compute(0.4) == pytest.approx(1.4)
    assert tp_comm.layer_time_over_compute(0.4, 1.0) == 1.0
    assert tp_comm.layer_time_over_compute(3.0, 1.0) == 3.0
    with pytest.raises(ValueError):
        tp_comm.layer_time_over_compute(0.4, 1.5)


def test_prediction_table_is_the_ring_formula():
    table = tp_comm.prediction_table(4, 8, 160, 0.0, 1e9, 4, tps=(2, 4), seq_lens=(32,))
    row = table.set_index("tp").loc[4]
    assert row["bytes/rank/step"] == 4 * 8 * 8 * 32 * 160 * 3 / 4 * 4
    assert row["predicted comm s/step"] == pytest.approx(row["bytes/rank/step"] / 1e9)


def test_prediction_table_with_the_embedding_and_head_all_reduces():
    # refimpl's whole TP GPT: 4 per layer, the embedding's (forward), the LM head's input gradient
    assert tp_comm.residual_all_reduces_per_step(4) == 18
    plain, ends = (tp_comm.prediction_table(4, 8, 160, 1e-5, 1e9, 4, tps=(2,), seq_lens=(32,),
                                            with_ends=w).iloc[0] for w in (False, True))
    assert ends["bytes/rank/step"] == plain["bytes/rank/step"] * 18 / 16
    assert ends["predicted comm s/step"] == pytest.approx(plain["predicted comm s/step"] * 18 / 16)


def test_placement_table_and_published_layers():
    # GPT-3 175B (Brown et al. 2020, Table 2.1) and Llama 2 7B (Touvron et al. 2023) from the presets
    assert tp_comm.layer_of("gpt3-175b") == tp_comm.LayerShape(1, 2048, 12288)
    assert tp_comm.layer_of("7b") == tp_comm.LayerShape(1, 4096, 4096)
    table = tp_comm.placement_table({"x": tp_comm.layer_of("7b")}, tps=(2, 8)).set_index("tp")
    r = table.loc[8, "NVLink comm/compute"]
    assert r == tp_comm.comm_to_compute(tp_comm.layer_of("7b"), 8, "h100-sxm", within_node=True)
    assert table.loc[8, "speed-up over 1 GPU, NVLink"] == pytest.approx(8 / (1 + r))


def test_gqa_table_llama2_70b_projection_sizes():
    # Llama 2 70B: h = 8192, 64 query heads, 8 K/V heads of 128 (its k_proj and v_proj are
    # 8192 x 1024 each, bf16: 16 MiB each, 32 MiB both, on one rank)
    gqa = tp_comm.gqa_table(8192, 64, 8, tps=(1, 8, 16))
    assert gqa.loc[1, "K,V weight MiB / rank"] == 32 and gqa.loc[1, "Q weight MiB / rank"] == 128
    assert gqa.loc[16, "K,V weight MiB / rank"] == gqa.loc[8, "K,V weight MiB / rank"] == 4
    assert gqa.loc[16, "ranks per K/V head"] == 2


def test_stage_flops_counted_by_torch_are_the_formula_and_the_head_weighs_on_the_last():
    from refimpl.lab.measure.pp_compare import stage_forward_flops, stage_forward_flops_formula
    from refimpl.model import GPTConfig

    cfg = GPTConfig(vocab_size=1024, seq_len=16, d_model=32, n_heads=4, n_layers=3)
    counted = stage_forward_flops(cfg, 2, batch=2)
    assert counted == stage_forward_flops_formula(cfg, 2, batch=2)
    # 3 blocks over 2 stages: 2 on the first, 1 + the LM head (2·h·V a token) on the last
    block = 2 * 16 * (2 * (4 * 32 * 32 + 2 * 32 * 128) + 4 * 16 * 32)
    assert counted == [2 * block, block + 2 * 16 * 2 * 32 * 1024]


def test_replay_sweep_matches_the_closed_forms_and_its_own_slots():
    sweep = bubble_sweep(4, micro_batches=(4, 8))
    assert (sweep.replayed - sweep.formula).abs().max() < 1e-12
    assert (sweep["replayed over ideal"] - sweep["over ideal"]).abs().max() < 1e-12
    # over ideal measured on slots: 1F1B, p=2, m=1 is one F+B of idle per rank per F+B of work
    assert over_ideal(replay(2, 1, "1f1b")) == pytest.approx(1.0)


def test_per_group_capacity_fills_first_choices_first():
    experts = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 0]])
    # one group, C = ceil(2*4/2 * 0.5) = 2 per expert: slot-major keeps every first choice
    keep = per_group_keep(experts, 2, 0.5, groups=1)
    assert keep[:, 0].all() and not keep[:, 1].any()
    # batch order keeps token 0's and 1's both choices and drops tokens 2, 3 entirely
    ours = global_keep(experts, 2, 0.5)
    assert ours.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    assert displaced_first_choices(experts, ours) == 2 and displaced_first_choices(experts, keep) == 0
    # two groups: each group of 2 tokens gets C_g = 1 per expert
    assert per_group_keep(experts, 2, 0.5, groups=2).sum() == 4
    with pytest.raises(ValueError, match="equal groups"):
        per_group_keep(experts, 2, 0.5, groups=3)


def test_orders_put_different_axes_across_nodes():
    shape, batch = get_model("70b")
    df = composition.order_costs({"dp": 2, "pp": 2, "tp": 4}, shape, 8, global_batch=batch)
    leaves = df.pivot(index="order", columns="axis", values="leaves the node")
    assert leaves.loc["refimpl (dp, pp, cp, tp)"].to_dict() == {"dp": True, "pp": False, "tp": False}
    assert leaves.loc["DeepSpeed (pipe, data, model)"].to_dict() == {"dp": False, "pp": True, "tp": False}
    groups = composition.groups_in_order({"dp": 2, "tp": 2}, ("dp", "tp"))
    assert groups == {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}


def test_ring_overlap_condition():
    hw = get_hardware("h100-sxm")
    c = cp_comm.min_overlap_chunk(hw, True)
    below, above = (cp_comm.ring_step_seconds(1, n, 4096, hw, True) for n in (int(c / 2), int(2 * c)))
    # latency aside, the crossover is where compute = transfer
    assert below[0] < below[1] and above[0] > above[1]


def test_dense_comparison_counts_agree():
    from refimpl.lab.predict.moe_arithmetic import dense_comparison

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=1, n_experts=4, top_k=2,
                    capacity_factor=2.0)
    df = dense_comparison(cfg, context=16)
    assert (df["params"] == df["formula params"]).all()
    assert (df["FLOPs/token (counted)"] == df["FLOPs/token (formula)"]).all()


def test_boundary_gradient_sketch_and_fix():
    from refimpl.lab.pipeline import boundary

    torch.manual_seed(0)
    first, last = torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(8, 1))
    inputs = torch.randn(3, 8)
    loss_fn = lambda y: y.pow(2).mean()  # noqa: E731
    received = first(inputs).detach()
    assert boundary.sketch_gradient(last, received, loss_fn) is None
    assert torch.allclose(boundary.fixed_gradient(last, received, loss_fn),
                          boundary.reference_gradient(first, last, inputs, loss_fn), rtol=0, atol=1e-7)


@pytest.mark.parametrize("layers, stages", [(4, 2), (4, 3), (7, 4), (10, 4), (30, 8), (8, 8)])
def test_the_sketchs_split_gives_the_remainder_to_the_last_stage(layers, stages):
    from refimpl.lab.pipeline.boundary import sketch_split
    from refimpl.parallel.pp.stage import partition

    sketch, ours = sketch_split(layers, stages), partition(layers, stages)
    for split in (sketch, ours):   # consecutive, every layer once
        assert [i for r in split for i in r] == list(range(layers))
    assert [len(r) for r in sketch] == [layers // stages] * (stages - 1) + [layers // stages + layers % stages]
    assert max(len(r) for r in ours) == -(-layers // stages)    # the fewest a slowest stage can hold
    assert max(len(r) for r in sketch) - max(len(r) for r in ours) == max(0, layers % stages - 1)


def test_p2p_messages_and_interleaved_peak_against_the_tables():
    from refimpl.lab.measure import pp_p2p_volume as p2p_volume
    from refimpl.lab.measure.pp_measure import predicted_activation_peak
    from refimpl.parallel.pp.schedules import Action, schedule_table

    for p, m, v in ((2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2)):
        table = schedule_table(p, m, "1f1b" if v == 1 else "interleaved", v)
        # a send per F that is not the last piece, per B that is not the first piece
        sends = sum((a.kind == "F" and a.chunk * p + r < v * p - 1) or (a.kind == "B" and a.chunk * p + r > 0)
                    for r, row in enumerate(table) for a in map(Action.parse, row))
        assert sends == p2p_volume.messages_per_step(p, m, v)
        if v > 1:
            assert [predicted_activation_peak(row, [1] * v) for row in table] == [
                p2p_volume.interleaved_peak_chunks(p, r, v) for r in range(p)]


def test_a_slow_stage_sets_the_pace():
    from refimpl.lab.measure.pp_replay import imbalanced_step

    extra = imbalanced_step(4, 64, 1, 2.0)["span"] - imbalanced_step(4, 32, 1, 2.0)["span"]
    assert extra == 32 * 2.0 * 3


def test_kv_heads_replicate_past_their_count():
    assert tp_comm.kv_heads_per_rank(8, 4) == (2, 1)
    assert tp_comm.kv_heads_per_rank(8, 16) == (1, 2)
    with pytest.raises(ValueError):
        tp_comm.kv_heads_per_rank(8, 3)
    with pytest.raises(ValueError):
        tp_comm.kv_heads_per_rank(6, 4)


@pytest.mark.ranks
def test_ring_rank_counts_blocks_and_saves_one_slice():
    from refimpl import launch
    from refimpl.lab.measure import cp_measure as measure
    from refimpl.lab.measure.cp_measure import score_blocks_per_rank

    rows = [r for rank in launch.run(measure.ring_rank, 2, seq=16, heads=2, head_dim=4) for r in rank]
    for kind, balanced in (("head-tail", True), ("contiguous", False)):
        assert [r["score_blocks"] for r in rows if r["layout"] == kind] == score_blocks_per_rank(2, balanced)
    # q, k, v, out for 8 tokens x 8 values, fp32, plus a log-sum-exp per query and head
    assert {r["saved_bytes"] for r in rows} == {4 * 8 * 8 * 4 + 2 * 8 * 4}
    assert measure.full_attention_saved_bytes(seq=16, heads=2, head_dim=4) > 2 * rows[0]["saved_bytes"]


def test_operators_do_not_grow_with_the_micro_batch():
    from refimpl.lab.measure.micro_batch import operator_calls
    from refimpl.model import build_model, synthetic_batch

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    model = build_model(cfg, 0)
    one, four = (operator_calls(model, synthetic_batch(cfg, b, cfg.seq_len, 0, 0)) for b in (1, 4))
    assert 0 < one and abs(four - one) <= 0.05 * one
