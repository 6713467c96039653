"""A hang on NCCL, shown on CPU (issue 52, item 8): an NCCL collective returns once posted and the
rank blocks later in a host read, so the flight recorder holds no open call. The launcher then
times the group out before itself, switches PyTorch's flight recorder on in the ranks'
environment, and reports each rank's last posted call. No rank is launched here: the launcher's
own functions run on fake ranks and rings written by hand."""
from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

from refimpl import launch
from refimpl.lab.runtime import flight_recorder, group_options
from refimpl.lab.runtime.watch import Watch
from refimpl.launch import LaunchTimeoutError, RankFailedError


def _ring(folder, rank, ops, monkeypatch):
    """Rank `rank`'s recorder after calling `ops`, each entered and left (NCCL: posted)."""
    monkeypatch.setenv(flight_recorder.ENV, str(folder))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(flight_recorder, "_ring", None)
    assert flight_recorder.active()
    for op in ops:
        with flight_recorder.entered(op, 64, None, None, None, "backward"):
            pass
    monkeypatch.setattr(flight_recorder, "_ring", None)


class _Running:
    """A rank process that never ends (or ends with `code` when told)."""

    def __init__(self, code=None):
        self.code, self.pid = code, 0

    def poll(self):
        return self.code


def _fake_ranks(tmp_path, codes):
    return [launch._Rank(r, _Running(c), tmp_path / f"out{r}", tmp_path / f"err{r}")
            for r, c in enumerate(codes)]


def _init_capture(monkeypatch, child: bool):
    """launch.init_process_group with torch's calls replaced: what timeout the group got."""
    got = {}
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: got.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: ("store", kw.get("timeout")))
    monkeypatch.setattr(group_options, "process_group_kwargs", lambda backend, local_rank: {})
    monkeypatch.setattr("torch.cuda.set_device", lambda index: None)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    if child:
        monkeypatch.setenv(launch._CHILD_MARK, "1")
    else:
        monkeypatch.delenv(launch._CHILD_MARK, raising=False)
    return got


@pytest.mark.parametrize("launch_s", [6.0, 120.0, 600.0, 3600.0])
def test_an_nccl_group_times_out_before_the_launcher(monkeypatch, launch_s):
    """The timeout init_process_group hands torch: on NCCL shorter than the launch (before the fix
    it was the launch's own, so the launcher killed the ranks before NCCL's watchdog could time
    the collective out and dump), on gloo the launch's."""
    got = _init_capture(monkeypatch, child=True)
    launch.init_process_group(0, 2, "nccl", launch_s)
    group_s = got["timeout"].total_seconds()
    margin = launch_s - group_s
    assert 0 < group_s < launch_s
    assert margin >= min(1.5, launch_s / 4)          # time left for the dump and the rank's end
    assert group_s >= 0.75 * launch_s                # the group keeps most of the launch's time
    launch.init_process_group(0, 2, "gloo", launch_s)
    assert got["timeout"] == datetime.timedelta(seconds=launch_s)


def _child_env(monkeypatch, tmp_path, backend):
    """The environment launch._start_rank gives a rank (the process itself is not started)."""
    seen = {}

    class Popen:
        def __init__(self, cmd, env, **kw):
            seen.update(env)

    monkeypatch.setenv("REFIMPL_LAUNCH", "spawn")        # no zygote: every backend via Popen
    monkeypatch.setattr(launch.subprocess, "Popen", Popen)
    launch._start_rank(1, 2, backend, 29999, tmp_path / "payload.pkl", tmp_path, 600.0, None)
    return seen


@pytest.mark.ranks   # launches a rank (the child's environment is read there)
def test_nccl_ranks_start_with_pytorchs_flight_recorder_on(monkeypatch, tmp_path):
    for name in list(flight_recorder.nccl_env(tmp_path)):
        monkeypatch.delenv(name, raising=False)
    env = _child_env(monkeypatch, tmp_path, "nccl")
    size = env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    dump = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    assert size is not None and int(size) > 0
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert dump is not None and os.path.isdir(os.path.dirname(dump))   # the dump has a folder
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"              # ends the rank, keeps the dump
    gloo = _child_env(monkeypatch, tmp_path, "gloo")
    assert not any(k.startswith(("TORCH_FR_", "TORCH_NCCL_")) for k in gloo)


@pytest.mark.ranks   # launches a rank (the child's environment is read there)
def test_a_flight_recorder_setting_of_the_caller_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    assert _child_env(monkeypatch, tmp_path, "nccl")["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_each_torch_gets_the_flight_recorder_variables_it_reads(tmp_path):
    new, old = (flight_recorder.nccl_env(tmp_path, v) for v in ("2.11.0", "2.5.1"))
    assert "TORCH_FR_BUFFER_SIZE" in new and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in new
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" in old and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in old
    assert not any(k.startswith("TORCH_FR_") for k in old)


def test_under_torchrun_an_nccl_rank_switches_the_recorder_on_itself(monkeypatch):
    """No launcher set the environment: init_process_group does, before the group exists."""
    for name in list(flight_recorder.nccl_env("x")):
        monkeypatch.delenv(name, raising=False)
    got = _init_capture(monkeypatch, child=False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: got.update(env=dict(os.environ), **kw))
    launch.init_process_group(0, 2, "nccl", 600.0)
    assert got["env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert got["timeout"].total_seconds() == 600.0    # no launcher to beat: --timeout as asked


# --- where an NCCL rank waits ------------------------------------------------------------------

def test_the_report_names_each_nccl_ranks_last_posted_call(tmp_path, monkeypatch):
    _ring(tmp_path, 0, ["all_reduce", "all_reduce", "all_gather"], monkeypatch)
    _ring(tmp_path, 1, ["all_reduce", "all_reduce"], monkeypatch)
    before = flight_recorder.hang_report(tmp_path, [0, 1])      # what gloo's report says
    assert "is in no recorded communication call" in before
    lines = flight_recorder.hang_report(tmp_path, [0, 1], posted=True).splitlines()
    assert lines[0].startswith("rank 0 last posted all_gather on the world (64 B, in backward)"
                               " (its call #2), and waits after it in a host read or synchronize")
    assert lines[1].startswith("rank 1 last posted all_reduce on the world (64 B, in backward)"
                               " (its call #1)")
    assert flight_recorder.waiting_in(tmp_path, [0, 1]) is None    # no open call: no stall seen
    assert flight_recorder.waiting_in(tmp_path, [0, 1], posted=True) == ((0, 2), (1, 1))


def test_the_launchers_stall_watchdog_fires_on_an_nccl_hang(tmp_path, monkeypatch):
    """Both ranks run on, and neither posts anything new: on NCCL that is the hang (before the fix
    the watchdog waited for an open call that never came, and the launch ran to its timeout)."""
    _ring(tmp_path, 0, ["all_reduce"], monkeypatch)
    _ring(tmp_path, 1, ["all_reduce"], monkeypatch)
    with pytest.raises(LaunchTimeoutError) as hang:
        Watch(tmp_path, "nccl", stall=0.3).wait(_fake_ranks(tmp_path, [None, None]), tmp_path, 60.0)
    text = str(hang.value)
    assert text.startswith("ranks [0, 1] each waited 0.3 s after the same posted call")
    assert "rank 0 last posted all_reduce" in text and "rank 1 last posted all_reduce" in text
    assert "host read or synchronize" in text and "flight recorder writes" in text
    with pytest.raises(LaunchTimeoutError) as gloo:           # gloo: open calls only, so the
        Watch(tmp_path, "gloo", stall=0.3).wait(_fake_ranks(tmp_path, [None, None]), tmp_path,
                                                1.0)            # timeout ends it
    assert "still running after 1 s" in str(gloo.value)


def test_a_rank_ended_by_nccls_watchdog_is_reported_with_where_each_rank_waits(tmp_path,
                                                                              monkeypatch):
    _ring(tmp_path, 0, ["all_reduce", "broadcast"], monkeypatch)
    _ring(tmp_path, 1, ["all_reduce"], monkeypatch)
    (tmp_path / "err1").write_text("Watchdog caught collective operation timeout")
    with pytest.raises(RankFailedError) as failed:
        Watch(tmp_path, "nccl").wait(_fake_ranks(tmp_path, [None, -6]), tmp_path, 60.0)
    text = failed.value.child_traceback
    assert "Watchdog caught" in text and "rank 0 last posted broadcast" in text
