"""refimpl.launch.run: results, notebook-cell functions, failures, timeouts, no leftovers."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from refimpl.lab.runtime.zygote_client import current_pid as zygote_pid
from refimpl.launch import LaunchTimeoutError, RankFailedError, run

pytestmark = pytest.mark.ranks   # launches rank processes (make test-fast skips it)


def _all_reduce_rank(rank, world_size, scale, offset=0):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": t.item() * scale + offset,
            "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}


def test_results_come_back_in_rank_order_with_args_and_kwargs():
    results = run(_all_reduce_rank, 3, 2.0, offset=1, quiet=True)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == (1 + 2 + 3) * 2.0 + 1 for r in results)
    # one thread per CPU rank, set before torch was imported in the child
    assert all(r["threads"] == 1 and r["omp"] == "1" for r in results)


def test_a_function_defined_in_a_notebook_cell_runs_on_every_rank():
    # A notebook cell's function lives in __main__, which a fresh interpreter cannot import:
    # cloudpickle must ship it by value, closure included.
    cell = textwrap.dedent("""
        factor = 10
        def per_rank(rank, world_size):
            return (rank + 1) * factor
    """)
    namespace = {"__name__": "__main__"}
    exec(compile(cell, "<notebook cell>", "exec"), namespace)
    assert run(namespace["per_rank"], 2, quiet=True) == [10, 20]


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    time.sleep(60)


def test_a_failing_rank_is_reported_with_its_number_and_traceback_and_others_killed():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run(_fail_on_rank_one, 2, quiet=True)
    assert time.monotonic() - start < 20          # not the 60 s rank 0 would sleep
    assert info.value.rank == 1
    assert "deliberate failure on rank one" in info.value.child_traceback
    assert "_fail_on_rank_one" in info.value.child_traceback
    assert "rank 1" in str(info.value)


def test_without_the_lab_a_failure_or_a_hang_is_still_caught(monkeypatch, tmp_path):
    """The core's own defaults (refimpl.launch_tools.LaunchTools: no zygote, no watch, no cause
    ranking): results in rank order, the failing rank named with its traceback, and a hang killed
    at the timeout."""
    from refimpl import launch, launch_tools

    monkeypatch.setattr(launch, "tools", launch_tools.LaunchTools)
    assert run(_identity, 2, 7, quiet=True) == [(0, 7), (1, 7)]
    with pytest.raises(RankFailedError) as info:
        run(_fail_on_rank_one, 2, quiet=True)
    assert info.value.rank == 1 and "deliberate failure on rank one" in info.value.child_traceback
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError, match="still running after 4 s"):   # (killed and
        run(_write_pid_and_hang, 2, str(tmp_path), timeout=4, quiet=True)      # waited for)
    assert time.monotonic() - start < 120                                      # not their 600 s


def _lose_rank_one_after_its_peer(rank, world_size):
    import torch
    import torch.distributed as dist

    from refimpl.lab.faults import lose_this_rank

    if rank == 1:   # its links go first; it is killed 1.5 s after rank 0's traceback
        lose_this_rank(rank, world_size)
    dist.all_reduce(torch.ones(1))     # fails on the closed connection
    time.sleep(60)


def test_the_rank_killed_by_a_signal_is_named_even_when_its_peer_exited_first():
    # The cause is the rank killed by SIGKILL, although rank 0 exited first and more than the
    # old fixed second before it (that launcher named rank 0, the first traceback).
    with pytest.raises(RankFailedError) as info:
        run(_lose_rank_one_after_its_peer, 2, quiet=True)
    assert info.value.rank == 1 and "killed by signal 9" in str(info.value), str(info.value)[:300]
    assert info.value.exit_order == [0, 1]
    assert info.value.others == {0: "traceback"}


def _write_pid_and_hang(rank, world_size, folder):
    with open(os.path.join(folder, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _pids(folder, n, wait=20):
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        files = [os.path.join(folder, f"pid{r}") for r in range(n)]
        if all(os.path.exists(f) and open(f).read() for f in files):
            return [int(open(f).read()) for f in files]
        time.sleep(0.1)
    raise AssertionError("ranks did not start")


def test_a_hang_ends_at_the_timeout_with_every_rank_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError):
        run(_write_pid_and_hang, 2, str(tmp_path), timeout=4, quiet=True)
    # The ranks sleep 600 s; ending well before that is the timeout's doing. The bound is loose
    # on purpose: start-up on a loaded 2-core machine has taken 18 s (a wall-clock bound near the
    # 4 s timeout failed a run there), and the claim is "does not hang", not "is fast".
    assert time.monotonic() - start < 120
    pids = _pids(tmp_path, 2, wait=0.1)
    assert not any(_alive(p) for p in pids)


def test_no_rank_survives_a_killed_caller(tmp_path):
    """A notebook kernel killed mid-run must not leave its ranks behind."""
    script = textwrap.dedent(f"""
        from refimpl.launch import run
        import tests.test_launch as t
        run(t._write_pid_and_hang, 2, {str(tmp_path)!r}, timeout=120)
    """)
    caller = subprocess.Popen([sys.executable, "-c", script], cwd=os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))
    pids = _pids(tmp_path, 2, wait=40)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _identity(rank, world_size, i):
    return (rank, i)


def test_many_launches_in_a_row_leak_nothing(tmp_path):
    """Repeated launches from one process: no leaked ports, files, processes or descriptors."""
    # 50 in a row was checked by hand (see the README); CI runs fewer to stay within its budget.
    repeats = int(os.environ.get("REFIMPL_LAUNCH_REPEATS", "10"))
    run(_identity, 2, 0, quiet=True)     # once first: the zygote and its two pipes stay open
    fds_before = len(os.listdir("/proc/self/fd"))
    children_before = _children()
    for i in range(repeats):
        assert run(_identity, 1 + i % 2, i, quiet=True)[0] == (0, i)
    assert len(os.listdir("/proc/self/fd")) <= fds_before
    # Every rank is gone; what remains is the one zygote the ranks are forked from.
    assert zygote_pid() in children_before and _children() == children_before


def _children() -> set:
    me = str(os.getpid())
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().split()[3] == me:
                        kids.add(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return kids


def test_under_torchrun_each_process_runs_fn_for_its_own_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        from refimpl.launch import run
        from tests.test_launch import _all_reduce_rank
        out = run(_all_reduce_rank, 99, 1.0)        # world_size comes from torchrun, not 99
        # one file per process: two processes printing to torchrun's shared stdout can interleave
        with open(os.path.join(os.path.dirname(__file__), "result" + os.environ["RANK"]), "w") as f:
            f.write(" ".join(map(str, ("RESULT", os.environ["RANK"], len(out), out[0]["rank"],
                                       out[0]["sum"]))))
    """))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", str(script)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted((tmp_path / f"result{r}").read_text() for r in range(2))
    assert lines == ["RESULT 0 1 0 3.0", "RESULT 1 1 1 3.0"]


def test_an_edited_source_restarts_the_zygote(monkeypatch):
    """The zygote has refimpl imported; a changed refimpl file must restart it, so a rank never
    runs code older than the files on disk (notebook users edit refimpl between launches). A
    stand-in Zygote records each start: no process is needed to check the rule."""
    from refimpl.lab.runtime import zygote_client as zc
    class Started:
        def __init__(self, env):
            self.env, self.sources = env, zc.source_stamp()

        def alive(self):
            return True

        def close(self):
            pass

    monkeypatch.setattr(zc, "Zygote", Started)
    monkeypatch.setattr(zc, "_CURRENT", None)
    stamps = iter([("a",), ("a",), ("b",), ("b",), ("b",)])
    monkeypatch.setattr(zc, "source_stamp", lambda: next(stamps))
    first = zc.for_backend("gloo")                     # starts one (stamp a)
    assert zc.for_backend("gloo") is first             # unchanged sources: kept
    second = zc.for_backend("gloo")                    # a file changed (stamp b): restarted
    assert second is not first and zc.for_backend("gloo") is second


def _torchrun_env(monkeypatch, rank=0, world=1):
    """This process as rank `rank` of a torchrun job (env://, a free port), not one of our children."""
    import socket

    from refimpl import launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank,
                       "LOCAL_WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv(launch._CHILD_MARK, raising=False)
    monkeypatch.delenv("REFIMPL_SHARED_DEVICE", raising=False)   # make test's staged default


def record_process_groups(monkeypatch) -> list:
    """(backend, timeout) of each process group refimpl.launch makes here; it is made on gloo
    whatever was asked (this machine may have no GPU)."""
    from refimpl import process_group

    made, real = [], process_group.init_process_group

    def init(rank, world_size, backend, timeout=600.0):
        made.append((backend, timeout))
        real(rank, world_size, "gloo", timeout=timeout)

    monkeypatch.setattr(process_group, "init_process_group", init)
    return made


def test_under_torchrun_the_backend_and_timeout_asked_for_are_used(monkeypatch):
    _torchrun_env(monkeypatch)
    made = record_process_groups(monkeypatch)
    out = run(_all_reduce_rank, 2, 1.0, backend="gloo", timeout=42.0)
    assert out[0]["sum"] == 1.0 and made == [("gloo", 42.0)]


def test_a_torchrun_seeing_fewer_gpus_than_ranks_says_it_falls_back_to_gloo(monkeypatch, capsys):
    """A Slurm task bound to one GPU while torchrun starts two ranks: NCCL is out, and the ranks
    run on gloo -- said in one line on stderr, not silently."""
    import torch

    from refimpl.lab.runtime.group_options import gloo_fallback_warning

    _torchrun_env(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    made = record_process_groups(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run(_all_reduce_rank, 2, 1.0)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert made == [("gloo", 600.0)] and "2 ranks on this node but this process sees 1 GPU" in line
    assert "CUDA_VISIBLE_DEVICES=3" in line and "Slurm job 77" in line and "gloo" in line
    assert gloo_fallback_warning(8, 8, {}) is None      # one GPU per rank: NCCL
    assert gloo_fallback_warning(2, 0, {}) is None      # a CPU node: gloo is the plan
