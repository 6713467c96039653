"""The arithmetic behind notebooks 00-05's seed sections: compute budgets, allocator rounding,
link bandwidths, the ZeRO family, DP scaling, op counts. Pure functions; one small profiled step."""
import math

import pandas as pd
import pytest
import torch

from refimpl.lab.measure import allocator
from refimpl.lab.measure.caching_allocator import CachingAllocator, replay
from refimpl.lab.predict import compute, dp_scaling, links, zero_family


def test_petaflop_day_and_chinchilla():
    assert compute.petaflop_days(8.64e19) == pytest.approx(1.0)
    assert compute.compute_optimal_tokens(70e9) == pytest.approx(1.4e12)   # Chinchilla, Table 3


def test_llama2_70b_gpu_hours_imply_about_40_percent_mfu():
    from refimpl.memory import training_flops

    flops = training_flops(70e9, 2e12)
    mfu = compute.implied_mfu(flops, "a100-80gb", 1_720_320)      # Llama 2 paper, Table 2
    assert 0.35 < mfu < 0.5
    cluster = compute.Cluster("2,048 A100", "a100-80gb", 2048)
    days = compute.days_on_cluster(flops, cluster, mfu)
    assert days == pytest.approx(1_720_320 / 2048 / 24)      # the same budget back in days


def test_allocator_rounding():
    assert allocator.block_bytes(1) == 512 and allocator.block_bytes(513) == 1024
    assert allocator.segment_bytes(1000) == 2 << 20                 # small pool
    assert allocator.segment_bytes((1 << 20) + 1) == 20 << 20       # a large request < 10 MiB
    assert allocator.segment_bytes((10 << 20) + 1) == 12 << 20      # rounded up to 2 MiB


MiB = 1 << 20


def test_small_requests_share_one_small_segment():
    alloc = CachingAllocator()
    for key in range(3):
        alloc.malloc(key, 1000)                       # 1024-byte blocks carved from one 2 MiB
    assert (alloc.reserved, alloc.allocated, len(alloc.segments)) == (2 * MiB, 3 * 1024, 1)


def test_a_hole_too_small_for_the_next_request_costs_a_new_segment():
    alloc = CachingAllocator()
    alloc.malloc("a", 6 * MiB)                        # a 20 MiB segment; 14 MiB stay cached
    alloc.malloc("b", 6 * MiB)                        # best fit: the 14 MiB block, 8 MiB left
    alloc.free("a")                                   # a 6 MiB hole at the segment's start
    alloc.malloc("c", 7 * MiB)                        # the 8 MiB block; a 1 MiB rest is not split
    assert alloc.live["c"][0].size == 8 * MiB and alloc.reserved == 20 * MiB
    alloc.malloc("d", 7 * MiB)                        # fits no hole: a second 20 MiB segment
    out = alloc.summary()
    assert (out["peak_reserved"], out["peak_allocated"], out["peak_requested"]) == (
        40 * MiB, 21 * MiB, 20 * MiB)
    assert out["fragmentation"] == 19 * MiB and out["segments"] == 2


def test_freed_neighbours_merge_into_one_block():
    alloc = CachingAllocator()
    alloc.malloc("a", 6 * MiB)
    alloc.malloc("b", 6 * MiB)
    alloc.free("b")
    alloc.free("a")                                   # a, b and the 8 MiB tail: one 20 MiB hole
    alloc.malloc("c", 18 * MiB)
    assert alloc.reserved == 20 * MiB and len(alloc.segments) == 1


def test_replay_skips_frees_of_tensors_made_before_the_recording():
    out = replay([(0x10, -4096), (0x20, 3000), (0x20, -3000), (0x30, 3000)])
    assert out["peak_requested"] == 3000 and out["peak_allocated"] == 3072
    assert out["segments"] == 1                       # the second 3000 B reused the first's block


def test_link_table_bandwidths_from_line_rates():
    t = links.link_table()
    assert t.loc["PCIe 4.0 x16", "GB/s per direction"] == pytest.approx(31.5, abs=0.1)
    assert t.loc["PCIe 5.0 x16", "GB/s per direction"] == pytest.approx(63.0, abs=0.1)
    assert t.loc["NVLink 4 (H100, 18 links)", "GB/s per direction"] == 450
    assert t.loc["InfiniBand NDR (4x)", "GB/s per direction"] == 50
    assert (t["GB/s per direction"] > 0).all() and t.index.is_unique


def test_zeropp_cuts_zero3_volume_fourfold():
    v = zero_family.zeropp_volume()
    assert v["total"] == pytest.approx(0.75)
    assert zero_family.ZERO3_VOLUME / v["total"] == pytest.approx(4.0)   # ZeRO++ abstract: 4x
    assert zero_family.zeropp_volume(weight_bits=16, grad_bits=16, hierarchical=False)["total"] == 3
    assert zero_family.hpz_extra_bytes(8e9, 8) == 2e9


def test_zero_infinity_capacity_and_intensity():
    fit = zero_family.largest_model(zero_family.DGX2, nodes=32)
    assert fit["GPU"] < fit["CPU"] < fit["NVMe"] and fit["NVMe"] > 32e12   # the paper's 32T fits
    assert zero_family.nvme_traffic_per_step(1) == 32
    t = zero_family.tokens_to_hide_nvme(100e12, 10e9)
    assert 6 * t / 100e12 == pytest.approx(32 / 10e9)          # compute time == transfer time


def test_deepspeed_stages_are_one_line_apart():
    cfgs = [zero_family.deepspeed_config(s) for s in range(4)]
    assert all(zero_family.changed_lines(a, b) == 1 for a, b in zip(cfgs, cfgs[1:]))
    off = zero_family.deepspeed_config(3, offload="nvme")["zero_optimization"]
    assert off["offload_param"] == {"device": "nvme"}
    assert "offload_param" not in zero_family.deepspeed_config(2, offload="cpu")["zero_optimization"]


def test_ring_from_two_rank_fit_grows_linearly_in_latency_flat_in_bandwidth():
    a2, b2, m = 1e-4, 1e9, 1e6
    assert dp_scaling.ring_from_two_rank_fit(2, m, a2, b2) == pytest.approx(a2 + m / b2)
    lat = [dp_scaling.ring_from_two_rank_fit(n, 0, a2, b2) for n in (2, 3, 4, 8)]
    assert lat == pytest.approx([a2, 2 * a2, 3 * a2, 7 * a2])
    bw = dp_scaling.ring_from_two_rank_fit(1000, m, 0, b2)
    assert bw < 2 * m / b2 and bw == pytest.approx(2 * m / b2, rel=1e-2)


def _summary(comm_us, compute_us):
    return pd.DataFrame({"rank": [0, 1], "steps": [2, 2], "comm_us": comm_us, "overlap_us": [0, 0],
                         "compute_us": compute_us, "comm_frac": [c / 1e3 for c in comm_us],
                         "overlap_frac": [0.0, 0.0]})


def test_per_step_times_reads_the_rank_that_waited_least():
    row = dp_scaling.per_step_times(_summary([400, 100], [1000, 1300]))
    assert row["rank"] == 1 and row.comm_us == 50 and row.compute_us == 650


def test_least_disturbed_times_takes_each_least_over_the_steps():
    # three steps; in each the rank that waited least is read, then the least comm and least compute
    per_step = {5: _summary([400, 100], [1000, 1300]), 6: _summary([90, 300], [2000, 1900]),
                7: _summary([500, 600], [700, 800])}
    trace = pd.DataFrame({"step": pd.array([5, 6, 7, None], dtype="Int64")})
    got = dp_scaling.least_disturbed_times(trace, lambda t: per_step[int(t.step.iloc[0])])
    # step 5's rank 1 (50, 650), step 6's rank 0 (45, 1000), step 7's rank 0 (250, 350)
    assert (got.comm_us, got.compute_us, got.steps) == (45, 350, 3)


def test_bottleneck_table_predicts_from_two_ranks():
    fits = pd.DataFrame({"alpha_s": [1e-4, 2e-4, 3e-4], "beta_bytes_per_s": [1e9] * 3}, index=[2, 3, 4])
    summaries = {n: _summary([100, 100], [1000, 1000]) for n in (2, 3, 4)}
    t = dp_scaling.bottleneck_table(fits, summaries, 1e6)
    assert t["comm share predicted"].is_monotonic_increasing
    assert t.loc[2, "all-reduce predicted (ms)"] == pytest.approx(t.loc[2, "all-reduce measured (ms)"])


def test_op_counts_see_the_recomputed_forward():
    from refimpl.lab.trace import op_counts
    from refimpl.model import GPTConfig, build_model, synthetic_batch
    from refimpl.model.activation_checkpointing import checkpoint_blocks

    cfg = GPTConfig()
    data = synthetic_batch(cfg, 2, 16, seed=0, step=0)
    plain = op_counts.profile_step(build_model(cfg, 0), data.inputs, data.targets)
    ckpt = op_counts.profile_step(checkpoint_blocks(build_model(cfg, 0)), data.inputs, data.targets)
    per_block = op_counts.linear_layers(build_model(cfg, 0).blocks[0])
    extra = op_counts.op_calls(ckpt, "aten::linear") - op_counts.op_calls(plain, "aten::linear")
    assert per_block == 6 and extra == per_block * cfg.n_layers
    assert "aten::linear" in plain.key_averages().table(row_limit=50)
    assert "--no-python nsys profile" in op_counts.nsys_command()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_profiled_step_sorts_by_device_time_only_where_it_ran_on_one(device):
    """The seed's table sorts by cuda_time_total: a GPU step records its kernels' device time and
    is sorted by it; a CPU step has none and is sorted by CPU time."""
    from refimpl.lab.trace import op_counts
    from refimpl.model import GPTConfig, build_model, synthetic_batch

    cfg = GPTConfig(n_layers=1)
    data = synthetic_batch(cfg, 2, 16, seed=0, step=0)
    prof = op_counts.profile_step(build_model(cfg, 0, device=device), data.inputs.to(device),
                                  data.targets.to(device))
    device_us = sum(e.self_device_time_total for e in prof.key_averages())
    assert (device_us > 0) == (device == "cuda")
    assert op_counts.time_column(prof) == ("cuda_time_total" if device == "cuda" else "cpu_time_total")
    assert "aten::linear" in prof.key_averages().table(sort_by=op_counts.time_column(prof), row_limit=50)


def test_zero_state_bytes_pads_units_only_at_stage_3():
    from refimpl.memory import model_state_bytes, zero_state_bytes

    units = [5, 5, 5]
    assert zero_state_bytes(units, dp=2, zero_stage=3).params == 4 * (3 + 3 + 3)
    assert zero_state_bytes(units, dp=2, zero_stage=2) == model_state_bytes(
        15, dp=2, zero_stage=2, param_bytes=4, grad_bytes=4, optimizer_bytes=8)


def test_all_reduce_lower_bound():
    from refimpl.lab.measure.traffic import all_reduce_lower_bound

    assert all_reduce_lower_bound(4, 4800) == 7200 and math.isclose(all_reduce_lower_bound(2, 1), 1)


def test_profiled_config_writes_under_the_group(tmp_path, monkeypatch):
    from refimpl.config import TrainConfig
    from refimpl.lab.trace import capture

    monkeypatch.setenv("REFIMPL_PROFILES", str(tmp_path))
    cfg = capture.profiled(TrainConfig(strategy="dp", nproc=2), "03_data_parallel", "dp")
    assert cfg.profile and cfg.trace_dir == str(tmp_path / "03_data_parallel" / "dp") and cfg.strategy == "dp"


def test_profiles_land_in_the_repos_folder_whatever_the_cwd(monkeypatch, tmp_path):
    """Notebooks run with notebooks/ as cwd; their traces must still reach `make tensorboard`'s logdir."""
    from pathlib import Path

    import refimpl
    from refimpl.lab.trace import capture

    monkeypatch.delenv("REFIMPL_PROFILES", raising=False)
    monkeypatch.chdir(tmp_path)
    repo = Path(refimpl.__file__).resolve().parent.parent
    assert capture.profiles_root() == repo / "profiles"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_activation_bytes_is_what_autograd_saves(dtype):
    """cp = 1 here, to the byte, in the model's dtype (the cp > 1 count is checked on the loop's
    ranks in tests/test_cp.py)."""
    from refimpl.lab.instrument.activations import measure_step_activations
    from refimpl.lab.predict.cp_comm import rank_activation_bytes
    from refimpl.model import GPTConfig, build_model
    from refimpl.model.data import synthetic_batch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for b, s, h, vocab, layers in ((4, 32, 64, 128, 2), (3, 24, 96, 200, 1)):
            cfg = GPTConfig(vocab_size=vocab, seq_len=s, d_model=h, n_heads=4, n_layers=layers)
            batch = synthetic_batch(cfg, b, s, 0, 0)
            saved = measure_step_activations(build_model(cfg, 0), batch.inputs, batch.targets)
            assert saved == rank_activation_bytes(cfg, b, s, dtype_bytes=dtype.itemsize)
    finally:
        torch.set_default_dtype(before)


def test_small_models_predicted_share_falls_with_width():
    """TP's FLOPs per byte sent is 9h(1 + s/6h)/((t-1)·bytes): it grows with the width, so the
    communication share falls, on this machine's fit and on a GPU preset alike."""
    from refimpl.lab.verify.small_models import predicted_shares, width_sweep

    models = width_sweep((64, 128, 256))
    table = predicted_shares(models, tp=2, global_batch=8, alpha_hop=5e-5, link=1e9,
                             matmul_rate=5e10, dtype_bytes=4)
    for m in models:
        h, s = m.d_model, m.seq_len
        assert table.loc[h, "FLOPs per byte sent"] == pytest.approx(9 * h * (1 + s / (6 * h)) / 4)
    for column in ("comm share predicted, this machine", "comm share predicted, h100-sxm"):
        assert table[column].is_monotonic_decreasing and table[column].between(0, 1).all()


def test_decomposed_ring_hides_the_shorter_of_transfer_and_matmul():
    from refimpl.lab.predict.tp_comm import decomposed_ring_seconds

    # 4 ranks, 1 MB chunks on a 1 GB/s link with 10 us per hop: a step's transfer is 1.01 ms
    for matmul_s, hidden in ((2e-3, 1.01e-3), (1e-4, 1e-4)):
        t = decomposed_ring_seconds(4, 1e6, matmul_s, 1e-5, 1e9)
        assert abs(t["collective_s"] - 3 * 1.01e-3) < 1e-12
        assert abs(t["saving_s"] - 3 * hidden) < 1e-12
        assert abs(t["overlapped_s"] - (3 * max(1.01e-3, matmul_s) + matmul_s)) < 1e-12


def test_only_the_share_of_a_transfer_on_hardware_of_its_own_is_hidden():
    from refimpl.lab.predict.tp_comm import decomposed_ring_seconds, transfer_engine_share

    # σ = 0: every byte copied by the core that multiplies: the decomposition is the serial time
    t = decomposed_ring_seconds(4, 1e6, 2e-3, 1e-5, 1e9, engine_share=0.0)
    assert t["saving_s"] == pytest.approx(0.0, abs=1e-15) and t["overlapped_s"] == pytest.approx(t["serial_s"])
    # σ = 0.5 of a 1.01 ms transfer runs beside a 2 ms matmul: 0.505 ms hidden per ring step
    assert decomposed_ring_seconds(4, 1e6, 2e-3, 1e-5, 1e9, engine_share=0.5)["saving_s"] == \
        pytest.approx(3 * 0.505e-3)
    # σ: GPUs 1; CPU ranks the spare cores, shared, at most one each
    assert transfer_engine_share("cuda", 8, cores=4) == 1.0
    assert [transfer_engine_share("cpu", ranks, cores) for ranks, cores in ((2, 2), (4, 2), (4, 6), (2, 16))] \
        == [0.0, 0.0, 0.5, 1.0]
