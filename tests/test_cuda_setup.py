"""A rank's CUDA setup, checked on a machine without a GPU (issue 35): the rank zygote never
touches CUDA before it forks, NCCL ranks create their communicators eagerly on their own GPU, and
the asynchronous lane issues its work on the rank's device."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from refimpl import launch

ROOT = Path(__file__).resolve().parents[1]

# Run the zygote's own imports (refimpl.lab.runtime.zygote.warm_imports) in a fresh interpreter with every
# Python entry point into CUDA watched: torch.cuda's initialisation and its device queries (which
# on a CUDA build initialise the driver, and on a CPU build are the only trace a call leaves).
_WATCHED = r"""
import json, sys, traceback
import torch
import torch.cuda

calls = []

def watch(owner, name):
    real = getattr(owner, name, None)
    if real is None:
        return
    def spy(*args, **kwargs):
        calls.append({"fn": name, "where": traceback.format_stack(limit=8)[:-1]})
        return real(*args, **kwargs)
    setattr(owner, name, spy)

for name in ("_lazy_init", "init", "is_available", "device_count", "current_device",
             "set_device", "get_device_properties", "get_device_capability", "mem_get_info"):
    watch(torch.cuda, name)
for name in ("_cuda_init", "_cuda_getDeviceCount", "_cuda_setDevice"):
    watch(torch._C, name)

from refimpl.lab.runtime.zygote import warm_imports
warm_imports()
json.dump({"calls": calls, "initialized": torch.cuda.is_initialized()}, sys.stdout)
"""


def test_the_zygote_imports_never_call_into_cuda():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _WATCHED], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    seen = json.loads(out)
    assert seen["initialized"] is False
    assert seen["calls"] == [], "".join(seen["calls"][0]["where"])


def test_nccl_ranks_bind_their_gpu_at_init_where_torch_can():
    from refimpl.lab.runtime.group_options import process_group_kwargs

    cuda3 = torch.device("cuda", 3)
    assert process_group_kwargs("nccl", 3, "2.11.0+cu130") == {"device_id": cuda3}
    assert process_group_kwargs("nccl", 3, "2.3.0") == {"device_id": cuda3}
    assert process_group_kwargs("nccl", 3, "2.2.2+cu121") == {}     # no eager init there
    for backend in ("gloo", "staged", "fake"):
        assert process_group_kwargs(backend, 3, "2.11.0") == {}


def test_init_process_group_hands_the_device_to_torch(monkeypatch):
    # torch.distributed itself is replaced: what matters is what our launcher asks of it.
    import torch.distributed as dist

    asked, bound = [], []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: asked.append((a, k)))
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    for name in (launch._CHILD_MARK, "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    launch.init_process_group(5, 8, "nccl")
    launch.init_process_group(5, 8, "gloo")
    assert bound == [1]
    (nccl_args, nccl_kwargs), (_, gloo_kwargs) = asked
    assert nccl_args == ("nccl",) and nccl_kwargs["device_id"] == torch.device("cuda", 1)
    assert "device_id" not in gloo_kwargs


def test_the_async_lane_issues_its_work_on_the_callers_device():
    # CPU here: the device the lane is told to use is recorded instead of set. A caller on
    # cuda:3 (the rank's GPU) gets its collectives run with cuda:3 current on the lane's thread.
    import threading

    from refimpl.lab.runtime.lane import Lane

    events, device = [], [3]
    lane = Lane(caller_device=lambda: device[0],
                 use_device=lambda i: events.append(("use", i, threading.current_thread().name)))

    def task():
        events.append(("run", None, threading.current_thread().name))

    lane.submit(task).wait()
    device[0] = None                              # a process that never initialised CUDA
    lane.submit(task).wait()
    assert [e[:2] for e in events] == [("use", 3), ("run", None), ("run", None)]
    assert all(name.startswith("comm-lane") for _, _, name in events)


def test_the_lane_asks_for_the_device_only_where_cuda_is_initialised(monkeypatch):
    # Asking torch for the current device would initialise CUDA (a context on GPU 0) in a process
    # that never used it: the lane asks only where CUDA is already initialised.
    from refimpl.lab.runtime import lane as work

    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append(1) or 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert work._caller_cuda_device() is None and asked == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert work._caller_cuda_device() == 2
