"""The debugging tools: the flight recorder's hang report, the divergence bisector, the faults
they are tried on, and bad files refused in one line. Notebook 10 runs every fault end to end;
here: each tool's logic on made-up records (no ranks), one real bisection and one real hang (the
other faults' diagnoses are notebook 10's asserts, run by make test too)."""
from __future__ import annotations

import pytest
import torch

from refimpl.lab import faults
from refimpl.lab.cli import main as cli
from refimpl.lab.config import LabConfig
from refimpl.lab.runtime import flight_recorder
from refimpl.lab.verify import bisect as bisector
from refimpl.launch import LaunchTimeoutError
from refimpl.mesh import LayoutError
from refimpl.model import GPT, GPTConfig
from refimpl.train import train_on_ranks, validate
from tests.models import SMALL

# --- the flight recorder, on rings written by hand --------------------------------------------

def _ring(folder, rank, calls, monkeypatch):
    monkeypatch.setenv(flight_recorder.ENV, str(folder))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(flight_recorder, "_ring", None)
    assert flight_recorder.active()
    for op, peer, tag, leave in calls:
        call = flight_recorder.entered(op, 64, None, peer, tag, "forward")
        call.__enter__()
        if leave:
            call.__exit__(None, None, None)
    monkeypatch.setattr(flight_recorder, "_ring", None)


def test_hang_report_names_each_stuck_call_and_its_peer(tmp_path, monkeypatch):
    _ring(tmp_path, 0, [("all_reduce", None, None, True), ("recv", 1, 5, False)], monkeypatch)
    _ring(tmp_path, 1, [("recv", 0, 9, False)], monkeypatch)
    _ring(tmp_path, 2, [("all_reduce", None, None, True)], monkeypatch)
    report = flight_recorder.hang_report(tmp_path, [0, 1, 2]).splitlines()
    assert report[0] == ("rank 0 waits in recv from rank 1 tag 5 (64 B, in forward); its peer "
                         "rank 1 waits in recv from rank 0 tag 9 (64 B, in forward)")
    assert report[1].startswith("rank 1 waits in recv from rank 0 tag 9")
    assert report[2] == ("rank 2 is in no recorded communication call; its last call was "
                         "all_reduce on the world (64 B, in forward)")


def test_waiting_in_is_each_ranks_innermost_call_or_none(tmp_path, monkeypatch):
    """The launcher's stall watchdog: a hang is when this stays the same; a rank in no call resets it."""
    _ring(tmp_path, 0, [("all_reduce", None, None, True), ("recv", 1, 5, False)], monkeypatch)
    _ring(tmp_path, 1, [("recv", 0, 9, False)], monkeypatch)
    _ring(tmp_path, 2, [("all_reduce", None, None, True)], monkeypatch)
    assert flight_recorder.waiting_in(tmp_path, [0, 1]) == ((0, 1), (1, 0))   # (rank, call's seq)
    assert flight_recorder.waiting_in(tmp_path, [0, 1, 2]) is None           # rank 2 is computing


def test_ring_keeps_the_last_calls_when_it_wraps(tmp_path, monkeypatch):
    n = flight_recorder.SLOTS + 10
    _ring(tmp_path, 0, [("send", 1, i, True) for i in range(n)], monkeypatch)
    tags = [r["tag"] for r in flight_recorder.read(tmp_path, 0)]
    assert tags == list(range(n - flight_recorder.SLOTS, n))


# --- the bisector's comparison, on records written by hand -------------------------------------

def _records(scale_block1=1.0, sp=False):
    fp = {m: torch.ones(1, 2, 4) for m in ("embed", "blocks.0", "blocks.1", "final_norm")}
    weights = {"embed.tok.weight": torch.ones(3), "blocks.0.w": torch.ones(3),
               "blocks.1.w": torch.ones(3) * scale_block1, "final_norm.weight": torch.ones(3)}
    step = {"loss": 2.0, "forward": fp, "backward": fp, "weights": weights}
    return {"rank": 0, "coords": {"tp": 0, "replica": 0}, "steps": [step]}


def test_bisector_adds_data_ranks_and_names_the_first_bad_module():
    ref = _records()
    halves = [_records(), _records()]
    for r, half in enumerate(halves):     # two data-parallel ranks, each half of the tokens
        half["rank"] = r
        for part in ("forward", "backward"):
            half["steps"][0][part] = {k: v / 2 for k, v in half["steps"][0][part].items()}
    assert bisector.compare(halves, ref, False, 1e-9)[0] is None
    halves[0]["steps"][0]["weights"]["blocks.1.w"] = torch.ones(3) * 1.01
    div = bisector.compare(halves, ref, False, 1e-9)[0]
    assert (div.step, div.phase, div.module) == (0, "optimizer", "blocks.1")
    halves[1]["steps"][0]["backward"]["blocks.0"] = torch.zeros(1, 2, 4)
    div = bisector.compare(halves, ref, False, 1e-9)[0]
    assert (div.phase, div.module) == ("backward", "blocks.0")   # backward runs before the step


def test_bisector_counts_one_tp_rank_unless_sequence_parallel():
    ref, a, b = _records(), _records(), _records()
    b["rank"], b["coords"] = 1, {"tp": 1, "replica": 0}
    assert bisector.compare([a, b], ref, False, 1e-9)[0] is None   # tp ranks hold the same tokens
    div = bisector.compare([a, b], ref, True, 1e-9)[0]             # under SP they are added
    assert (div.phase, div.module) == ("forward", "embed")


# --- faults are refused outside the debugging notebook and tests --------------------------------

def test_faults_run_only_where_asked_and_on_their_layout(monkeypatch):
    """The launcher's layout check (refimpl.train.validate) refuses them: the faults' plug-in of
    the registry (refimpl.lab.faults.variant) checks them as it picks the fault's class."""
    cfg = LabConfig(strategy="dp-naive", nproc=2, fault="skip-grad-sync")
    monkeypatch.delenv(faults.ENV, raising=False)
    with pytest.raises(LayoutError, match="injects a bug on purpose"):
        validate(cfg)
    monkeypatch.setenv(faults.ENV, "1")
    validate(cfg)
    with pytest.raises(LayoutError, match="needs --strategy dp-naive"):
        validate(cfg.with_(strategy="zero1"))
    with pytest.raises(LayoutError, match="unknown fault"):
        validate(cfg.with_(fault="typo"))


# --- bad files: one line, exit 2, before any rank starts ---------------------------------------

def test_bad_files_exit_2_with_one_line(tmp_path, capsys):
    good = tmp_path / "good.pt"
    torch.save(GPT(GPTConfig()).state_dict(), good)
    data = good.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[:len(data) // 2])
    (tmp_path / "garbage.pt").write_text("not a checkpoint")
    torch.save(GPT(GPTConfig(d_model=32, n_heads=4)).state_dict(), tmp_path / "other.pt")
    (tmp_path / "a_file").write_text("")
    cases = {
        ("--init-state", str(tmp_path / "truncated.pt")): "torch.load can read",
        ("--init-state", str(tmp_path / "garbage.pt")): "torch.load can read",
        ("--init-state", str(tmp_path / "other.pt")): "in this model",
        ("--save-state", str(tmp_path / "missing" / "x.pt")): "does not exist",
        ("--profile", "--trace-dir", str(tmp_path / "a_file" / "t")): "is a file, not a folder",
    }
    for flags, says in cases.items():
        assert cli(["train", *flags]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, (flags, err)


# --- one real run of each tool ------------------------------------------------------------------

@pytest.mark.ranks
def test_bisector_finds_a_missing_gradient_sync(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    cfg = LabConfig(strategy="dp-naive", nproc=2, steps=2, model=SMALL, dtype="float64",
                    fault="skip-grad-sync")      # clean layouts: notebook 10 bisects them
    report = bisector.bisect(cfg)
    last = f"blocks.{SMALL.n_layers - 1}"
    assert report.verdict == "bug"
    assert (report.first.step, report.first.phase, report.first.module) == (0, "optimizer", last)


@pytest.mark.ranks
@pytest.mark.parametrize("device", [None, "cpu"], ids=["gloo", "nccl-order"])
def test_a_hang_is_reported_with_both_stuck_calls(monkeypatch, device):
    """A hang report on gloo and under NCCL's stream order (the staged backend): there the runner
    posts in one fixed order, and the fault once broke that order itself, so notebook 10's hang
    ended in a RuntimeError on NCCL instead of hanging (Links.post_ahead). gloo pairs messages by
    tag, so rank 0 waits in B3, the receive the fault posted early; NCCL pairs them in posting
    order, so that receive takes B0's gradient, the rest shift by one, and the wait shows in B1."""
    monkeypatch.setenv(faults.ENV, "1")
    if device is None:
        monkeypatch.delenv("REFIMPL_SHARED_DEVICE", raising=False)
    else:
        monkeypatch.setenv("REFIMPL_SHARED_DEVICE", device)
    cfg = LabConfig(strategy="pp-1f1b", nproc=2, pp=2, micro_batches=4, steps=1, model=SMALL,
                    fault="p2p-misordered")
    with pytest.raises(LaunchTimeoutError) as hang:
        train_on_ranks(cfg, timeout=6)
    lines = str(hang.value).splitlines()[1:]
    waits_in = "pp:B3" if device is None else "pp:B1"
    assert lines[0].startswith("rank 0 waits in recv-wait from rank 1 tag ") and f"in {waits_in}" in lines[0]
    assert lines[1].startswith("rank 1 waits in recv-wait from rank 0 tag ") and "in pp:F2" in lines[1]
    assert "its peer rank 1 waits in recv-wait from rank 0" in lines[0]


@pytest.mark.ranks
def test_the_bisector_runs_zero3():
    """The bisector steps the strategy outside the loop's ActivationTracker, whose saved-tensor
    hooks hid that ZeRO-3's backward regather wrote into the buffer the forward's saved
    parameters view: autograd refused the backward ("modified by an inplace operation") until
    the regather wrote past the version counter (refimpl.parallel.fsdp.sharded_unit.gather)."""
    from tests.models import SMALL

    cfg = LabConfig(strategy="zero3", nproc=2, steps=2, global_batch=4, model=SMALL, dtype="float64")
    report = bisector.bisect(cfg)          # fsdp steps through the same units
    assert report.first is None, report.summary()     # and nothing diverges from single
