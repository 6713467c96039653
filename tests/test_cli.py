"""`python -m refimpl train`: the JSON contract, and bad arguments rejected before any rank starts."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "refimpl", "train", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_train_json_has_the_documented_fields(tmp_path):
    proc = _cli("--steps", "3", "--profile", "--trace-dir", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["strategy"] == "single" and out["world_size"] == 1
    assert len(out["losses"]) == 3 and all(isinstance(x, float) for x in out["losses"])
    assert out["step_time_s"] > 0 and out["n_params"] > 1_000_000
    (mem,) = out["memory"]
    assert set(mem) == {"params", "grads", "optimizer", "activations_peak", "total", "peak",
                        "transient_peak"}
    assert mem["total"] == mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations_peak"]
    assert mem["peak"] is None        # the profiler that --profile runs drops allocator events
    assert out["trace_dir"] == str(tmp_path) and list(tmp_path.glob("rank0.*.pt.trace.json"))


def test_peak_is_what_a_rank_held_during_a_step():
    # The peak is measured from the allocator's own events: above what the rank keeps between
    # steps (model states), by at least the activations autograd saved for backward.
    proc = _cli("--strategy", "dp", "--nproc", "2", "--steps", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    for mem in json.loads(proc.stdout)["memory"]:
        kept = mem["params"] + mem["grads"] + mem["optimizer"]
        assert mem["peak"] == kept + mem["transient_peak"]
        assert mem["transient_peak"] >= mem["activations_peak"]


@pytest.mark.parametrize("args, says", [
    (["--strategy", "no-such"], "unknown strategy"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--layers", "-1"], "n_layers must be >= 1"),
    (["--experts", "4", "--top-k", "5"], "--top-k must be in [1, --experts = 4]"),
    (["--strategy", "dp", "--nproc", "3", "--tp", "2"], "multiple of pp x cp x tp"),
    (["--strategy", "dp", "--set", "bucket_mb=0"], "bucket_mb must be > 0"),
    (["--collectives", "nccl"], "--collectives must be one of"),
    (["--timeout", "-1"], "--timeout must be > 0"),
    (["--device", "tpu"], "device must be auto, cpu or cuda"),
    (["--nproc", "2"], "at most 1"),
    (["--global-batch", "6", "--micro-batches", "4"], "multiple of --micro-batches"),
    (["--heads", "7"], "divisible by n_heads"),
    (["--seq-len", "1000"], "--seq-len"),
])
def test_bad_arguments_exit_2_with_one_line(args, says, capsys):
    from refimpl.lab.cli import main

    assert main(["train", *args]) == 2            # returned before anything was launched
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], captured.err
    assert captured.out == ""


def test_the_exit_code_reaches_the_shell():
    proc = _cli("--strategy", "no-such", timeout=120)
    assert proc.returncode == 2 and "unknown strategy" in proc.stderr




def test_under_torchrun_device_cpu_and_timeout_reach_the_process_group(monkeypatch, capsys):
    """`torchrun ... -m refimpl train --device cpu --timeout 77` on a node with GPUs enough for
    NCCL: the ranks' group is gloo's (the run is kept on the CPU), with the asked-for timeout."""
    import torch

    from refimpl.lab.cli import main
    from tests.test_launch import _torchrun_env, record_process_groups

    _torchrun_env(monkeypatch)
    made = record_process_groups(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)    # 8 GPUs: NCCL by default
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert main(["train", "--device", "cpu", "--timeout", "77", "--steps", "1", "--json"]) == 0
    assert made == [("gloo", 77.0)]
    assert json.loads(capsys.readouterr().out)["world_size"] == 1
