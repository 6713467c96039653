"""The planner's mixture-of-experts layouts (refimpl.lab.plan.moe): parameter counts against the built
model, ep in the search, and the model-state bytes against the loop on 4 CPU ranks."""
from dataclasses import replace

import pytest

from refimpl.lab.plan import MODELS, Layout, plan
from refimpl.lab.plan.cli import plan_main
from refimpl.lab.plan.cpu_calibration import shape_of
from refimpl.lab.plan.moe_cpu import MOE_MODEL, moe_states_table
from refimpl.lab.plan.predict import predict, predict_memory
from refimpl.lab.predict.hardware import GPUS
from refimpl.lab.predict.moe_arithmetic import mixtral_8x7b
from refimpl.model import build_model


@pytest.mark.parametrize("tied", [False, True])
def test_moe_parameter_count_is_the_built_models(tied):
    cfg = replace(MOE_MODEL, tie_embeddings=tied)
    model = build_model(cfg, 0)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    shape = shape_of(cfg, cfg.seq_len)
    assert (shape.expert_params, shape.dense_params) == (expert, dense)
    assert shape.n_params == expert + dense


def test_mixtral_preset_counts_as_the_published_arithmetic():
    # two independent writings of Mixtral 8x7B: the planner's shape and refimpl.cost's count
    shape, _ = MODELS["mixtral-8x7b"]
    published = mixtral_8x7b()
    assert (shape.n_params, shape.active_params) == (published.total_params, published.active_params)
    assert 46.6e9 < shape.n_params < 46.8e9 and 12.8e9 < shape.active_params < 13.0e9


def test_experts_over_ep_dense_over_dp_cp():
    shape, batch = MODELS["mixtral-8x7b"]
    one, eight = (predict_memory(shape, Layout(dp=8, tp=8, ep=ep), batch) for ep in (1, 8))
    # Without ZeRO the dense states are the same at any ep; the experts (~96 % of the
    # parameters) are cut 8 ways: so the states shrink by more than 5x but less than 8x.
    ratio = one["params_bytes"] / eight["params_bytes"]
    assert 5 < ratio < 8
    # ZeRO-1 on dp 8 with ep 8: edp = 1, so the experts' optimizer states are not sharded at all,
    # while with ep 1 they are cut over all 8: the same bytes either way for the experts' Adam.
    z1 = (predict_memory(shape, Layout(dp=8, tp=8, ep=ep, zero_stage=1), batch) for ep in (1, 8))
    z1_one, z1_eight = z1
    assert z1_one["optimizer_bytes"] == pytest.approx(z1_eight["optimizer_bytes"], rel=1e-12)
    # the all-to-alls are counted where experts are spread, and only there
    hw = GPUS["a100-80gb"]
    assert predict(shape, Layout(dp=8, tp=8, ep=8), batch, hw)["ep_comm_s"] > 0
    assert predict(shape, Layout(dp=8, tp=8, ep=1), batch, hw)["ep_comm_s"] == 0


def test_plan_enumerates_ep_for_experts_only():
    space = dict(micro_batch_sizes=(1,), recompute=("full",), cp_sizes=(1,), zero_stages=(1,))
    shape, batch = MODELS["mixtral-8x7b"]
    moe = plan(**shape.to_dict(), global_batch=batch, gpus=64, **space)
    assert set(moe.ep) == {1, 2, 4, 8}
    assert (moe.dp % moe.ep == 0).all() and moe.fits.any()
    shape, batch = MODELS["7b"]
    assert set(plan(**shape.to_dict(), global_batch=batch, gpus=16, **space).ep) == {1}


def test_cli_prints_ep(capsys):
    assert plan_main(["--model", "mixtral-8x7b", "--gpus", "64", "--micro-batch-sizes", "1",
                      "--recompute", "full", "--cp", "1", "--zero-stages", "1", "--top", "3"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[:5] == ["dp", "tp", "pp", "cp", "ep"]
    assert plan_main(["--model", "mixtral-8x7b", "--gpus", "64", "--ep", "3"]) == 2
    assert "must divide the 8 experts" in capsys.readouterr().err


@pytest.mark.ranks
def test_moe_model_states_match_the_loop():
    """One launch of 4 ranks, five layouts (zero1/zero3/fsdp/zero2 with ep, one with tp, one with
    pp): the planner's parameter, gradient and optimizer bytes within 1 % of what each rank holds."""
    table = moe_states_table()
    errors = table[[c for c in table.columns if c.endswith("_err")]]
    assert (errors.abs() < 0.01).all().all(), table.to_string()
