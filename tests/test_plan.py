"""The planner (refimpl.lab.plan) against published trainings, and its rules on small cases.

Narayanan et al. 2021, Table 1: ten GPT models trained on up to 3072 A100s with the techniques of
the time (tensor + pipeline + data parallelism, full activation recomputation, no ZeRO, no sequence
or context parallelism). Searching that same space, the planner should put their grid among its
best few, and predict a throughput near the one they measured.
"""
import pytest

from refimpl.lab.measure.this_machine import cpu_preset
from refimpl.lab.plan import Layout, best_per_grid, megatron_runs, plan
from refimpl.lab.plan.cli import plan_main
from refimpl.lab.plan.cpu import cpu_layouts, train_config
from refimpl.lab.plan.predict import predict, predict_memory
from refimpl.lab.plan.published import TECHNIQUES_2021, compare_with_megatron, published_grid_ranks
from refimpl.lab.predict.hardware import GPUS
from refimpl.lab.predict.presets import MODELS, ModelShape, megatron_flops
from refimpl.model import GPTConfig


@pytest.fixture(scope="module")
def megatron_table():
    return compare_with_megatron(with_all_techniques=False)


def test_published_throughput_is_predicted_within_15_percent(megatron_table):
    ratio = megatron_table.predicted_tflops / megatron_table.achieved_tflops
    assert ratio.between(0.85, 1.15).all(), megatron_table.assign(ratio=ratio).to_string()


def test_published_grid_is_among_the_best_few(megatron_table):
    # Known misses (the report says why): 18.4B (t=8, p=1) and 39.1B (t=8, p=2), where the model
    # prefers t=2..4 with more pipeline stages; each still within 12% of the predicted best.
    top3 = megatron_table.grid_rank <= 2
    assert top3.sum() >= 8, megatron_table.to_string()
    assert (megatron_table.slower_than_best <= 0.12).all(), megatron_table.to_string()


def test_with_every_technique_the_published_grid_is_in_the_top_five():
    """Today's question of the published runs: with ZeRO, SP, cp, selective recomputation and bf16
    allowed, their (t, p) is among the planner's five best (t, p) for at least 7 of the eleven of
    Narayanan et al. (Table 1 and GPT-3 175B; before the fixes in the report of issue 24, 4: ring
    hops hidden at s = 2048, ZeRO-2 reducing once per step, 16-bit gradients in bf16, ring
    attention's scores moving no bytes). BLOOM 176B and Llama 3 405B, on the networks they trained
    on, make thirteen: 10 in the top five when they were added (8, BLOOM 4th, Llama 3 1st)."""
    ranks = published_grid_ranks()
    assert len(ranks) == 13 and ranks.grid_rank.notna().all(), ranks.to_string()
    assert (ranks.grid_rank.iloc[:11] < 5).sum() >= 7, ranks.to_string()
    assert (ranks.grid_rank < 5).sum() >= 10, ranks.to_string()
    assert (ranks.slower_than_best <= 0.2).all(), ranks.to_string()


def test_bloom_and_llama3_are_presets_of_their_published_size():
    """BLOOM 176B (176.2B parameters, Le Scao et al. 2022) in this planner's 4h-MLP, multi-head
    form, and Llama 3 405B as released (its Llama block, counted exactly): within 1.5 %
    (refimpl.lab.predict.presets says what BLOOM's form leaves out)."""
    for name, billions in (("bloom-176b", 176.2), ("llama3-405b", 405)):
        assert MODELS[name][0].n_params / 1e9 == pytest.approx(billions, rel=0.015), name


def test_ring_hops_are_exposed_at_short_sequences_and_zero2_reduces_every_micro_batch():
    """Liu et al. 2023: a hop hides behind a block's attention only when s/c >= 2·rate/bandwidth
    (A100 over NVLink: ~2k tokens with the causal half); ZeRO-2 shards the gradients, so each
    micro-batch is reduce-scattered, ZeRO-1 reduces once per step."""
    a100 = GPUS["a100-80gb"]
    shape, batch = MODELS["gpt3-175b"]
    lay = Layout(dp=16, tp=4, pp=8, cp=2, zero_stage=1)
    short = predict(shape, lay, batch, a100)
    long_ = predict(ModelShape(96, 12288, 96, 51200, 32768), lay, 128, a100)
    assert short["cp_comm_s"] > 0.01 * short["tp_comm_s"] and long_["cp_comm_s"] == 0.0
    dp = {(z, m): predict(shape, Layout(dp=8, tp=8, pp=1, zero_stage=z, micro_batch_size=1),
                          8 * m, a100)["dp_comm_s"] for z in (1, 2) for m in (1, 4)}
    assert dp[1, 4] == pytest.approx(dp[1, 1]) and dp[2, 4] > 2 * dp[2, 1]


def test_gpt3_on_1024_gpus_takes_about_34_days():
    from refimpl.lab.predict.presets import GPT3_ON_1024 as g
    from refimpl.lab.predict.presets import training_days_of

    shape, _ = MODELS[g["model"]]
    df = plan(**shape.to_dict(), global_batch=g["global_batch"], gpus=g["gpus"], **TECHNIQUES_2021)
    grids = best_per_grid(df)
    theirs = grids[(grids.tp == g["tp"]) & (grids.pp == g["pp"])]
    assert int(theirs.index[0]) <= 2, grids.head().to_string()
    days = training_days_of(theirs.step_time_s.iloc[0], g["global_batch"], shape.seq_len, g["tokens"])
    assert abs(days / g["days"] - 1) <= 0.15, days   # predicted 30.1 days


def test_executed_flops_match_megatrons_formula():
    run = megatron_runs()[6]   # 145.6B
    lay = Layout(dp=24, tp=8, pp=8, recompute="full")
    row = predict(run["shape"], lay, run["global_batch"], GPUS["a100-80gb"])
    assert row["executed_flops"] == pytest.approx(megatron_flops(run["shape"], run["global_batch"]),
                                                  rel=1e-9)


def test_tensor_parallelism_stays_inside_a_node():
    """The seed's placement rule, derived: across nodes the tp all-reduces dominate."""
    shape, batch = MODELS["gpt3-175b"]
    df = plan(**shape.to_dict(), global_batch=batch, gpus=1024)
    assert df.fits.iloc[0] and df.tp.iloc[0] <= 8
    inside = predict(shape, Layout(dp=16, tp=8, pp=8), batch, GPUS["a100-80gb"])
    across = predict(shape, Layout(dp=8, tp=16, pp=8), batch, GPUS["a100-80gb"])
    assert across["tp_comm_s"] > 5 * inside["tp_comm_s"]
    assert Layout(tp=8).within_node("tp", 8) and not Layout(tp=16).within_node("tp", 8)
    assert not Layout(dp=2, tp=8).within_node("dp", 8) and Layout(dp=2, tp=4).within_node("dp", 8)


def test_every_row_is_a_valid_layout_and_the_table_is_ranked():
    shape, batch = MODELS["70b"]
    df = plan(**shape.to_dict(), global_batch=batch, gpus=64)
    assert (df.dp * df.tp * df.pp * df.cp == 64).all()
    assert (shape.n_heads % df.tp == 0).all() and (shape.n_layers % df.pp == 0).all()
    assert (batch % (df.dp * df.micro_batch_size) == 0).all()
    assert df.fits.any() and not df.fits.all()
    n_fit = int(df.fits.sum())
    assert df.fits.iloc[:n_fit].all() and not df.fits.iloc[n_fit:].any()
    assert df.step_time_s.iloc[:n_fit].is_monotonic_increasing
    capacity = 0.9 * GPUS["a100-80gb"].memory_bytes
    assert (df.memory_bytes[df.fits] <= capacity).all() and (df.memory_bytes[~df.fits] > capacity).all()


def test_1f1b_first_stage_holds_p_micro_batches():
    shape, batch = MODELS["gpt3-175b"]
    one = predict_memory(shape, Layout(dp=batch, tp=8, pp=8, micro_batch_size=1), batch * 8)
    # same stage, but m = 1 micro-batch in flight instead of 8 (the global batch is one per rank)
    few = predict_memory(shape, Layout(dp=batch, tp=8, pp=8, micro_batch_size=1), batch)
    assert one["activation_bytes"] / few["activation_bytes"] == pytest.approx(8, rel=0.02)
    zero3 = predict_memory(shape, Layout(dp=16, tp=8, pp=8, zero_stage=3), batch)
    plain = predict_memory(shape, Layout(dp=16, tp=8, pp=8, zero_stage=0), batch)
    assert zero3["params_bytes"] * 16 == pytest.approx(plain["params_bytes"])


@pytest.mark.parametrize("d_model, heads, seq, rows, cp, precision", [
    (160, 8, 64, 2, 2, "fp32"),       # the loop's small model on a 2-rank ring
    (256, 8, 256, 1, 4, "fp32"),
    (4096, 32, 4096, 2, 8, "bf16"),   # the 7B preset's block
    (8192, 64, 4096, 1, 2, "bf16"),   # the 70B preset's block
])
def test_planner_cp_activations_are_what_a_ring_rank_saves(d_model, heads, seq, rows, cp, precision):
    """One block's activations under ring attention, as the planner predicts them for refimpl's
    block, are refimpl.lab.predict.cp_comm.rank_activation_bytes' (which test_cp checks against what
    autograd saves), to the byte: a block is the difference between a 2- and a 1-block model."""
    from refimpl.lab.predict.cp_comm import rank_activation_bytes

    act = {"fp32": 4, "bf16": 2}[precision]
    planner, ring = [], []
    for layers in (1, 2):
        shape = ModelShape(layers, d_model, heads, 1000, seq, tied_embeddings=False)
        planner.append(predict_memory(shape, Layout(cp=cp, micro_batch_size=rows), rows, precision,
                                      activations="refimpl")["activation_bytes"])
        model = GPTConfig(vocab_size=1000, seq_len=seq, d_model=d_model, n_heads=heads,
                          n_layers=layers)
        ring.append(rank_activation_bytes(model, rows, seq, cp, dtype_bytes=act))
    assert planner[1] - planner[0] == ring[1] - ring[0]


def test_cli_prints_the_seeds_70b_table(capsys):
    assert plan_main(["--model", "70b", "--gpus", "64", "--top", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[0].split()[:4] == ["dp", "tp", "pp", "cp"]
    shape, batch = MODELS["70b"]
    best = plan(**shape.to_dict(), global_batch=batch, gpus=64).iloc[0]
    assert lines[1].split()[:4] == [str(best.dp), str(best.tp), str(best.pp), str(best.cp)]
    assert plan_main(["--model", "nope", "--gpus", "64"]) == 2
    from refimpl.lab.cli import main  # the same table through `python -m refimpl plan`
    assert main(["plan", "--model", "70b", "--gpus", "64", "--top", "3"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == lines
    assert plan_main(["--layers", "2", "--d-model", "64", "--heads", "3", "--vocab", "10",
                      "--seq-len", "8", "--global-batch", "5", "--gpus", "7"]) == 2


def test_cpu_layouts_have_runnable_commands():
    from refimpl.lab.cli import build_parser
    from refimpl.train import validate

    hw = cpu_preset(5e10, 2e-4, 2e9, 5e9, block_overhead_s=2e-4)
    df = cpu_layouts(hw, world_size=4)
    assert (df.dp * df.tp * df.pp * df.cp == 4).all() and df.fits.all()
    for command in df.command:   # every row's command line parses and passes the loop's checks
        args = build_parser().parse_args(command.split()[3:])
        assert args.nproc == 4
    for _, row in df.iterrows():
        validate(train_config(row, 4, GPTConfig(), 8, 32, steps=2))
    # with no overlap on CPU, ZeRO-3's per-micro-batch gathers are exposed: slower than ZeRO-2
    pure_dp = df[(df.tp == 1) & (df.pp == 1) & (df.cp == 1)]
    z = pure_dp[pure_dp.recompute == "none"].set_index("zero_stage")
    assert z.step_time_s[3] > z.step_time_s[2]
