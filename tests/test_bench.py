"""refimpl.cost.alpha_beta, refimpl.lab.measure.bench and refimpl.lab.predict.strategy_cost: the arithmetic, no
ranks needed."""
import math

import numpy as np
import pandas as pd
import pytest

from refimpl.cost import alpha_beta
from refimpl.lab.measure import bench
from refimpl.lab.predict import strategy_cost


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_busbw_factors_are_nccl_tests(n):
    assert alpha_beta.busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert alpha_beta.busbw_factor(op, n) == pytest.approx((n - 1) / n)
    for op in ("broadcast", "reduce", "send_recv"):
        assert alpha_beta.busbw_factor(op, n) == 1.0
    with pytest.raises(ValueError):
        alpha_beta.busbw_factor("gossip", n)


def test_message_sizes_default_is_4_bytes_to_64_mb():
    sizes = bench.message_sizes()
    assert sizes[0] == 4 and sizes[-1] == 64 << 20 and len(sizes) == 25
    assert bench.message_sizes(4, 1024, 4) == [4, 16, 64, 256, 1024]


def test_fit_recovers_alpha_and_beta_exactly_without_noise():
    sizes = np.array(bench.message_sizes(4, 64 << 20, 4), dtype=float)
    alpha, beta = 25e-6, 3e9
    alpha_fit, beta_fit = alpha_beta.fit_alpha_beta(sizes, alpha + sizes / beta)
    assert alpha_fit == pytest.approx(alpha, rel=1e-6) and beta_fit == pytest.approx(beta, rel=1e-6)
    err = bench.fit_error(sizes, alpha + sizes / beta, alpha_fit, beta_fit)
    assert err["r2_log"] == pytest.approx(1.0) and err["max_rel_err"] < 1e-6


def test_fit_is_robust_to_relative_noise():
    rng = np.random.default_rng(0)
    sizes = np.array(bench.message_sizes(4, 64 << 20, 2), dtype=float)
    alpha, beta = 100e-6, 1e9
    noisy = (alpha + sizes / beta) * rng.uniform(0.9, 1.1, sizes.size)
    alpha_fit, beta_fit = alpha_beta.fit_alpha_beta(sizes, noisy)
    assert alpha_fit == pytest.approx(alpha, rel=0.1) and beta_fit == pytest.approx(beta, rel=0.1)
    assert bench.fit_error(sizes, noisy, alpha_fit, beta_fit)["median_rel_err"] < 0.1


def test_fit_never_returns_negative_parameters():
    sizes = np.array([4, 64, 1024, 16384], dtype=float)
    flat = np.full(4, 1e-4)  # no size dependence: beta must come out infinite, alpha the level
    alpha, beta = alpha_beta.fit_alpha_beta(sizes, flat)
    assert alpha == pytest.approx(1e-4) and math.isinf(beta)
    alpha, beta = alpha_beta.fit_alpha_beta(sizes, sizes / 1e9)  # no latency: alpha 0
    assert alpha == pytest.approx(0.0, abs=1e-15) and beta == pytest.approx(1e9)


def test_fit_table_and_predictions_cover_each_group():
    sizes = bench.message_sizes(4, 1 << 20, 4)
    rows = [{"impl": impl, "op": "all_reduce", "world_size": 2, "size_bytes": m,
             "time_s": a + m / b} for impl, a, b in (("torch", 1e-5, 2e9), ("refimpl", 2e-5, 1e9))
            for m in sizes]
    df = pd.DataFrame(rows)
    fits = bench.fit_table(df).set_index("impl")
    assert fits.loc["torch", "alpha_s"] == pytest.approx(1e-5)
    assert fits.loc["refimpl", "beta_bytes_per_s"] == pytest.approx(1e9)
    pred = bench.with_predictions(df, fits.reset_index())
    assert np.allclose(pred.predicted_s, pred.time_s)


TINY = strategy_cost.TrainingShape("tiny", n_params=1_000_000, n_layers=4, hidden=192, seq_len=64,
                                micro_batch=8, n_micro_batches=4, bytes_per_value=4)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_cost_table_bytes_per_strategy(n):
    t = strategy_cost.cost_table(TINY, n).set_index("strategy")
    psi_b = 4_000_000
    act = 8 * 64 * 192 * 4
    assert t.loc["DP", "sent_per_rank_bytes"] == pytest.approx(2 * (n - 1) / n * psi_b)
    # ZeRO-3 moves 1.5x DP's volume (ZeRO paper, section 7): 3 Psi vs 2 Psi
    dp_bytes = t.loc["DP", "sent_per_rank_bytes"]
    assert t.loc["ZeRO-3 / FSDP", "sent_per_rank_bytes"] == pytest.approx(1.5 * dp_bytes)
    assert t.loc["ZeRO-3 / FSDP", "calls_per_step"] == 3 * 4
    assert t.loc["TP", "sent_per_rank_bytes"] == pytest.approx(4 * 4 * 4 * 2 * (n - 1) / n * act)
    assert t.loc["TP", "calls_per_step"] == 4 * 4 * 4 and t.loc["TP", "message_bytes"] == act
    assert t.loc["PP", "sent_per_rank_bytes"] == 2 * 4 * act and t.loc["PP", "calls_per_step"] == 8
    assert "predicted_s" not in t.columns


def test_cost_table_times_use_the_fitted_model():
    fits = pd.DataFrame([{"impl": "torch", "op": op, "world_size": 2, "alpha_s": 1e-4,
                          "beta_bytes_per_s": 1e9}
                         for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv")])
    t = strategy_cost.cost_table(TINY, 2, fits).set_index("strategy")
    assert t.loc["DP", "predicted_s"] == pytest.approx(1e-4 + 4e6 / 1e9)
    assert t.loc["ZeRO-3 / FSDP", "predicted_s"] == pytest.approx(12 * 1e-4 + 3 * 4e6 / 1e9)
    assert strategy_cost.cost_table(TINY, 4, fits)["predicted_s"].isna().all()  # no fit for 4 ranks


def test_7b_dp_traffic_on_8_ranks():
    t = strategy_cost.cost_table(strategy_cost.LLAMA_7B, 8).set_index("strategy")
    assert t.loc["DP", "sent_per_rank_bytes"] / 1e9 == pytest.approx(2 * 7 / 8 * 6.738415616 * 2, rel=1e-9)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_our_algorithms_send_what_the_one_table_says(op, n):
    # The exact per-rank count of refimpl.comm's algorithms, on a tensor that divides evenly,
    # is the factor written once in refimpl.cost.collective_bytes.
    from refimpl.cost.collective_bytes import sent_per_rank
    from refimpl.lab.measure.traffic import expected_sent

    numel = 12 * 1024
    for rank in range(n):
        assert expected_sent(op, rank, n, numel) == pytest.approx(sent_per_rank(op, n, numel * 4))
