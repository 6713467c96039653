"""Every contract of ../shared/DESIGN.md ("Contracts other parts and users rely on"), imported from
the path DESIGN writes and called once, so that moving a file can never break one silently.

The CLI's JSON keys and the launcher's failure modes have their own, deeper tests
(tests/test_cli.py, tests/test_launch.py); here each name is reached where users reach it.
"""
import inspect
import json

import pytest
import torch


def _world_linear_shapes(rank, world_size):
    import torch.nn as nn

    from refimpl.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    lin = nn.Linear(8, 12)
    col = ColumnParallelLinear.from_linear(lin, group=None, gather_output=True)   # the default group
    row = RowParallelLinear.from_linear(nn.Linear(12, 8), group=None, input_is_parallel=False)
    x = torch.randn(3, 8)
    return tuple(col.weight.shape), tuple(row.weight.shape), bool(torch.allclose(col(x), lin(x)))


@pytest.mark.ranks
def test_launch_run_returns_rank_order_and_takes_kwargs():
    from refimpl.launch import run

    assert run(lambda rank, world_size, a, b=0: rank * a + b, 2, 10, b=1, backend="auto",
               timeout=60, quiet=True) == [1, 11]


def test_cli_train_json(capsys):
    from refimpl.lab.cli import main

    assert main(["train", "--strategy", "single", "--nproc", "1", "--steps", "2",
                 "--global-batch", "4", "--seq-len", "16", "--seed", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"strategy", "world_size", "losses", "step_time_s", "n_params", "memory",
            "trace_dir"} <= out.keys() and len(out["losses"]) == 2
    assert {"params", "grads", "optimizer", "activations_peak", "total"} <= out["memory"][0].keys()
    assert main(["train", "--strategy", "tp", "--nproc", "3"]) == 2    # bad layout: exit 2


def test_memory_model_state_bytes_is_the_zero_papers_k12():
    from refimpl.memory import model_state_bytes

    full = model_state_bytes(7_500_000_000, dp=64, zero_stage=0, param_bytes=2, grad_bytes=2,
                             optimizer_bytes=12)
    assert full.total == 16 * 7_500_000_000 == full.params + full.grads + full.optimizer
    stage3 = model_state_bytes(7_500_000_000, dp=64, zero_stage=3)   # ZeRO paper, Fig. 1: 1.9 GB
    assert round(stage3.total / 1e9, 1) == 1.9


def test_activation_bytes_per_layer_is_korthikanti_table_2():
    from refimpl.memory import activation_bytes_per_layer

    s, b, h, a = 2048, 1, 12288, 96
    assert activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True,
                                      recompute="selective") == s * b * h * 34 / 8


def test_comm_rebuilds_torch_distributed_with_the_same_signatures():
    import torch.distributed as dist

    import refimpl.comm as comm

    for name in ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
                 "reduce_scatter", "all_to_all_single"):
        ours, theirs = inspect.signature(getattr(comm, name)), inspect.signature(getattr(dist, name))
        # torch's parameters, in torch's order; ours may add keyword-only knobs after them
        # (all_reduce's `algorithm`: ring, tree or halving-doubling)
        assert list(ours.parameters)[:len(theirs.parameters)] == list(theirs.parameters), name
        assert all(p.default is not p.empty for p in list(ours.parameters.values())[
            len(theirs.parameters):]), name


def test_bench_busbw_and_alpha_beta_fit():
    from refimpl.bench import busbw_factor, fit_alpha_beta

    assert busbw_factor("all_reduce", 4) == 2 * 3 / 4
    sizes = [1e3, 1e5, 1e7]
    alpha, beta = fit_alpha_beta(sizes, [2e-5 + n / 5e9 for n in sizes])
    assert alpha == pytest.approx(2e-5, rel=1e-6) and beta == pytest.approx(5e9, rel=1e-6)


def test_mesh_parallel_dims_groups_are_designs_example():
    from refimpl.mesh import ParallelDims

    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert dims.world_size == 8
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_pp_schedule_table_and_bubble_fraction():
    from refimpl.parallel.pp.runner import bubble_fraction, schedule_table

    table = schedule_table(4, 8, "1f1b")
    assert len(table) == 4 and table[3][:2] == ["F0", "B0"]
    assert bubble_fraction(4, 8, "1f1b") == pytest.approx(3 / 11)      # (p - 1) / (m + p - 1)
    assert schedule_table(2, 4, "interleaved", virtual_stages=2)[0][0] == "F0.0"


@pytest.mark.ranks
def test_tp_layers_from_linear_default_to_the_world_group():
    from refimpl.launch import run

    # 2 ranks, group=None: each holds half of the column layer's rows and of the row layer's
    # columns, and the gathered output is nn.Linear's.
    for col, row, same in run(_world_linear_shapes, 2, quiet=True):
        assert col == (6, 8) and row == (8, 6) and same


def test_plan_returns_layouts_fastest_first():
    from refimpl.lab.plan import plan

    df = plan(n_layers=24, d_model=2048, n_heads=16, vocab_size=50304, seq_len=2048,
              global_batch=64, gpus=16, gpu="a100-80gb", gpus_per_node=8)
    assert {"dp", "tp", "pp", "cp", "zero_stage", "micro_batch_size", "memory_bytes",
            "step_time_s", "fits"} <= set(df.columns)
    assert df.fits.iloc[0] and df[df.fits].step_time_s.is_monotonic_increasing
    assert (df.dp * df.tp * df.pp * df.cp == 16).all()


def test_module_level_wrappers_have_designs_signatures():
    # Behaviour: tests/test_wrappers.py (each against plain training, with PyTorch's twins).
    from refimpl.parallel.dp import DataParallel
    from refimpl.parallel.fsdp import FullyShard
    from refimpl.parallel.zero import ShardedOptimizer

    def head(cls, n):   # the contract's leading parameters: (name, kind, default)
        return [(p.name, p.kind.name, p.default) for p in
                list(inspect.signature(cls.__init__).parameters.values())[1:n + 1]]

    empty = inspect.Parameter.empty
    assert head(DataParallel, 3) == [("module", "POSITIONAL_OR_KEYWORD", empty),
                                     ("group", "KEYWORD_ONLY", None), ("bucket_mb", "KEYWORD_ONLY", 25.0)]
    assert head(FullyShard, 4) == [("module", "POSITIONAL_OR_KEYWORD", empty),
                                   ("group", "KEYWORD_ONLY", None),
                                   ("compute_dtype", "KEYWORD_ONLY", None), ("units", "KEYWORD_ONLY", None)]
    sig = inspect.signature(ShardedOptimizer.__init__).parameters
    assert [(n, p.kind.name, p.default) for n, p in list(sig.items())[1:6]] == [
        ("params", "POSITIONAL_OR_KEYWORD", empty), ("optimizer_cls", "POSITIONAL_OR_KEYWORD", empty),
        ("group", "KEYWORD_ONLY", None), ("partition", "KEYWORD_ONLY", "tensors"),
        ("offload", "KEYWORD_ONLY", False)] and sig["defaults"].kind.name == "VAR_KEYWORD"
    assert issubclass(DataParallel, torch.nn.Module) and issubclass(FullyShard, torch.nn.Module)
    assert issubclass(ShardedOptimizer, torch.optim.Optimizer)
    for cls, methods in ((DataParallel, ("finish_gradient_synchronization", "no_sync")),
                         (FullyShard, ("finish_gradient_synchronization", "full_state_dict")),
                         (ShardedOptimizer, ("step", "zero_grad", "add_param_group", "state_dict",
                                             "load_state_dict"))):
        assert all(callable(getattr(cls, m)) for m in methods)
