"""Recovery (refimpl.lab.checkpoint.run_checkpoint): a run resumed from step k is the uninterrupted run, under
any layout, and a kill in the middle of writing a checkpoint leaves the previous one whole.

The torchrun scenario (a rank killed with kill -9, torchrun --max-restarts 1 restarts the job, it
resumes) is scripts/launch_check.py's, behind `make launch-check`: it starts torchrun several times.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest
import torch
from safetensors import safe_open

from refimpl.config import TrainConfig
from refimpl.lab.checkpoint import dcp_convert, run_checkpoint, sharded_checkpoint
from refimpl.lab.config import LabConfig
from refimpl.lab.loop import train_several_on_ranks
from refimpl.lab.verify import checkpoint_memory
from refimpl.lab.verify.equivalence import compare_states
from refimpl.mesh import LayoutError
from refimpl.model import GPTConfig, build_model, count_params
from refimpl.train import train_on_ranks, validate
from tests.models import SMALL

GATE = 1e-9   # float64 (refimpl.lab.verify.equivalence)


def run_cfg(strategy="single", nproc=1, steps=4, **kw) -> TrainConfig:
    kw = {"global_batch": 4, "model": SMALL, **kw}
    return LabConfig(strategy=strategy, nproc=nproc, steps=steps, dtype="float64",
                     return_state=True, **kw)


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow   # three in-process runs: seconds, too many for make test-fast
def test_single_resumed_from_step_k_is_the_uninterrupted_run(tmp_path):
    whole = train_on_ranks(run_cfg(steps=3))
    first = train_on_ranks(run_cfg(steps=2, checkpoint_every=1, checkpoint_dir=str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000002"]
    resumed = train_on_ranks(run_cfg(steps=3, checkpoint_dir=str(tmp_path)))
    assert first["resumed_from"] == 0 and resumed["resumed_from"] == 2
    # the same process, the same order of sums: bit for bit, losses and weights
    assert resumed["losses"] == whole["losses"]
    assert all(torch.equal(resumed["state_dict"][k], whole["state_dict"][k]) for k in whole["state_dict"])
    saved = run_checkpoint.load_latest(tmp_path)
    assert saved["optimizer"]["step"] == 2 and saved["losses"] == whole["losses"][:2]


@pytest.mark.ranks
def test_resumed_under_another_layout_equals_single_and_the_uninterrupted_run(tmp_path):
    """Two steps under zero1 on 2 ranks (checkpoint at step 2), then steps 3-4 under tp 2, and
    under torch-fsdp2 from the checkpoint converted to DCP's format (refimpl.lab.checkpoint.dcp_convert):
    the losses of all four steps and the final weights equal single's and an uninterrupted tp 2
    run's."""
    single = train_on_ranks(run_cfg())
    first = train_on_ranks(run_cfg("zero1", 2, steps=2, checkpoint_every=2,
                                    checkpoint_dir=str(tmp_path)))
    # bytes written per rank against the shard arithmetic: zero1 keeps the weights whole on both
    # ranks (each weight written once, by whichever holder has written less so far) and m, v in
    # halves of the flat buffer: N weights + 2N moments in all, even to within one weight
    n, item = first["n_params"], 8                        # float64
    written = _bytes_per_rank(tmp_path / "step-00000002")
    assert sum(written) == 3 * n * item
    largest = max(t.numel() for t in first["state_dict"].values()) * item
    assert abs(written[0] - written[1]) <= largest < n * item / 4
    twin_dir = tmp_path / "dcp"
    dcp_convert.convert_to_dcp(tmp_path / "step-00000002", twin_dir)
    resumed, twin, whole = train_several_on_ranks([
        run_cfg("tp", 2, checkpoint_dir=str(tmp_path)),
        run_cfg("torch-fsdp2", 2, checkpoint_dir=str(twin_dir)), run_cfg("tp", 2)])
    assert resumed["resumed_from"] == twin["resumed_from"] == 2
    for run in (resumed, twin, whole):
        assert max_rel(run["losses"], single["losses"]) < GATE
        assert compare_states(run["state_dict"], single["state_dict"])[0] < GATE
    for run in (resumed, twin):
        assert max_rel(run["losses"], whole["losses"]) < GATE
        assert compare_states(run["state_dict"], whole["state_dict"])[0] < GATE


@pytest.mark.ranks
def test_pytorch_twins_resume_through_dcp_resharded_equal_to_the_uninterrupted_run(tmp_path):
    """torch-ddp and torch-fsdp2 checkpoint through torch.distributed.checkpoint on 2 ranks (step
    2); each resumes under the other twin on 3 ranks (FSDP2's DTensor shards cut anew, DDP's
    replicas made whole from FSDP2's shards): steps 3-4 equal single's and an uninterrupted
    torch-fsdp2 run's, losses and weights, in float64."""
    ddp, fsdp2 = tmp_path / "ddp", tmp_path / "fsdp2"

    def twin(strategy, nproc, steps=4, **kw):   # 6 rows: 2 and 3 ranks take equal ones
        return run_cfg(strategy, nproc, steps, global_batch=6, **kw)
    single = train_on_ranks(run_cfg(global_batch=6))
    train_several_on_ranks([twin("torch-ddp", 2, 2, checkpoint_every=2, checkpoint_dir=str(ddp)),
                            twin("torch-fsdp2", 2, 2, checkpoint_every=2, checkpoint_dir=str(fsdp2))])
    index = json.loads((fsdp2 / "step-00000002" / sharded_checkpoint.INDEX).read_text())
    assert index["format"] == "dcp" and (fsdp2 / "step-00000002" / ".metadata").exists()
    runs = train_several_on_ranks([twin("torch-fsdp2", 3, checkpoint_dir=str(ddp)),
                                   twin("torch-ddp", 3, checkpoint_dir=str(fsdp2)),
                                   twin("torch-fsdp2", 3)])
    *resumed, whole = runs
    assert [r["resumed_from"] for r in resumed] == [2, 2]
    for run in runs:
        assert max_rel(run["losses"], single["losses"]) < GATE
        assert compare_states(run["state_dict"], single["state_dict"])[0] < GATE
    for run in resumed:
        assert max_rel(run["losses"], whole["losses"]) < GATE
        assert compare_states(run["state_dict"], whole["state_dict"])[0] < GATE


def _bytes_per_rank(path) -> list[int]:
    """Tensor bytes of weights and moments in each rank's file (the generator state aside)."""
    out = []
    for r in range(2):
        f = safe_open(str(path / sharded_checkpoint.rank_file(r)), "pt")
        out.append(sum(f.get_tensor(k).nbytes for k in f.keys() if not k.startswith("rng/")))
    return out


def _killed_while(tmp_path, stage: str) -> None:
    """A child process starts writing checkpoint 2 and is SIGKILLed mid-way: inside its rank
    file (half the bytes written) or after every file, just before the directory's rename."""
    pid = os.fork()
    if pid == 0:     # the child: never returns to pytest
        try:
            if stage == "bytes":
                real_save = sharded_checkpoint.save_file

                def half_then_die(tensors, name):
                    real_save(tensors, name)
                    with open(name, "rb+") as f:
                        f.truncate(os.path.getsize(name) // 2)
                    os.kill(os.getpid(), signal.SIGKILL)
                sharded_checkpoint.save_file = half_then_die
            else:
                os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
            ck = sharded_checkpoint.ShardedCheckpoint(tmp_path / "step-00000001")
            f = ck.file(sharded_checkpoint.rank_file(0))
            tmp = tmp_path / ".step-00000002.tmp-test"
            tmp.mkdir()
            sharded_checkpoint.write_file_atomically({k: f.get_tensor(k) for k in f.keys()},
                                                     tmp / sharded_checkpoint.rank_file(0))
            run_checkpoint.commit(tmp, tmp_path / "step-00000002", {**ck.index, "step": 2},
                                  [sharded_checkpoint.rank_file(0)])
        finally:
            os._exit(3)   # not reached when the kill landed
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize("stage", ["bytes", "rename"])
def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one_usable(tmp_path, stage):
    train_on_ranks(run_cfg(steps=1, checkpoint_every=1, checkpoint_dir=str(tmp_path)))
    _killed_while(tmp_path, stage)
    stray = [n for n in os.listdir(tmp_path) if n.startswith(".step-00000002.tmp-")]
    assert len(stray) == 1                                   # the half-written bytes are there...
    assert run_checkpoint.latest_checkpoint(tmp_path).name == "step-00000001"   # ...unseen
    resumed = train_on_ranks(run_cfg(steps=2, checkpoint_dir=str(tmp_path)))
    assert resumed["resumed_from"] == 1
    assert resumed["losses"] == train_on_ranks(run_cfg(steps=2))["losses"]


def test_what_cannot_resume_fails_before_launch(tmp_path):
    with pytest.raises(LayoutError, match="needs --checkpoint-dir"):
        validate(run_cfg(checkpoint_every=2))
    with pytest.raises(LayoutError, match="not for 'torch-zero1'"):
        validate(run_cfg("torch-zero1", 2, checkpoint_dir=str(tmp_path)))
    with pytest.raises(LayoutError, match="every sharded tensor a DTensor: not with --tp 2"):
        validate(run_cfg("torch-fsdp2", 4, tp=2, checkpoint_dir=str(tmp_path)))
    validate(run_cfg("ep", 2, model=dataclasses.replace(SMALL, n_experts=4), checkpoint_dir=str(tmp_path)))
    train_on_ranks(run_cfg(steps=2, checkpoint_every=2, checkpoint_dir=str(tmp_path)))
    with pytest.raises(LayoutError, match="has format 2, 'torch-ddp' reads 'dcp'"):
        validate(run_cfg("torch-ddp", 2, checkpoint_dir=str(tmp_path)))
    with pytest.raises(LayoutError, match="lr=0.003, this run has lr=0.1"):
        validate(run_cfg(checkpoint_dir=str(tmp_path), lr=0.1))
    with pytest.raises(LayoutError, match="at step 2, beyond --steps 1"):
        validate(run_cfg(steps=1, checkpoint_dir=str(tmp_path)))
    validate(run_cfg("zero3", 2, checkpoint_dir=str(tmp_path)))     # another layout: fine


# A model of many small tensors, so that the whole state (weights, m, v: 10.4 MB in float64)
# stands out against a rank's shard (a quarter of it on 4 ranks) and one tensor (the MLP's
# 64 x 256 weight, 131 kB).
MANY_TENSORS = GPTConfig(vocab_size=256, seq_len=16, d_model=64, n_heads=4, n_layers=8)


def _check_shard_plus_one_tensor(found: list[dict], nproc: int) -> None:
    reference = build_model(MANY_TENSORS, 0, device="meta")
    whole = 3 * count_params(reference) * 8                       # weights, m, v in float64
    largest = max(t.numel() for t in reference.state_dict().values()) * 8
    for r, f in enumerate(found):
        print(f"rank {r}: save +{f['save_peak']} B (file {f['written']} B), load peak "
              f"{f['load_peak']} B = kept {f['kept']} B + {f['load_peak'] - f['kept']} B; "
              f"whole state {whole} B, largest tensor {largest} B")
        # a save on the CPU writes this rank's own tensors: no copy of them (it once copied all
        # it wrote, beside them in the same memory; issue 52); a load holds, beside what it
        # keeps, the tensor it assembles and the slice of it read from a file
        assert f["save_peak"] <= largest
        assert f["kept"] <= f["load_peak"] <= f["kept"] + 2 * largest + 1024
    # every rank writes its share of the whole state, to within one tensor
    assert sum(f["written"] for f in found) == whole
    assert all(abs(f["written"] - whole / nproc) <= largest for f in found)


@pytest.mark.ranks
def test_a_save_and_a_resharding_load_hold_a_shard_plus_one_tensor(tmp_path):
    """ZeRO-3 on 2 ranks saves; ZeRO-1 on the same 2 ranks loads (its moments once built the
    whole flat buffer, the whole model's m, before sharding it: 6 MB beside 8.7 MB kept at 4
    ranks; now each parameter's m, v are read into the shard one at a time)."""
    def cfg(strategy):
        return run_cfg(strategy, 2, steps=1, model=MANY_TENSORS, seq_len=16)
    _check_shard_plus_one_tensor(checkpoint_memory.measure(cfg("zero3"), cfg("zero1"), tmp_path), 2)


@pytest.mark.full
@pytest.mark.ranks
@pytest.mark.parametrize("write,read", [("zero3", "zero1"), ("zero1", "fsdp")])
def test_on_4_ranks_a_save_and_a_resharding_load_hold_a_shard_plus_one_tensor(tmp_path, write, read):
    def cfg(strategy):
        return run_cfg(strategy, 4, steps=1, model=MANY_TENSORS, seq_len=16)
    found = checkpoint_memory.measure(cfg(write), cfg(read), tmp_path)
    _check_shard_plus_one_tensor(found, 4)
