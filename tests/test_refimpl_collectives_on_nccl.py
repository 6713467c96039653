"""`--collectives refimpl` on NCCL is refused (issue 52, item 6): refimpl.comm's asynchronous lane
is a second host thread, which on a GPU would post on the default stream where backward runs, and
on its communicators in an order that can differ between ranks (a deadlock on NCCL). The run is
refused in one line before any rank starts; on gloo it runs as before (tests/test_collectives_seam.py)."""
from __future__ import annotations

import pytest
import torch

from refimpl import launch
from refimpl.config import TrainConfig
from refimpl.mesh import LayoutError
from refimpl.train import validate
from tests.models import SMALL

REASON = "--collectives refimpl runs on gloo only"


@pytest.fixture
def eight_gpus(monkeypatch):
    """A machine where two ranks get NCCL: 8 GPUs, no shared-device harness, not under torchrun."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for name in ("REFIMPL_SHARED_DEVICE", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "_start_rank", no_rank)


def test_the_cli_refuses_refimpl_collectives_on_nccl_in_one_line(eight_gpus, capsys):
    from refimpl.lab.cli import main

    assert main(["train", "--strategy", "dp", "--nproc", "2", "--collectives", "refimpl"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and REASON in lines[0] and "deadlock" in lines[0], captured.err


def test_a_layout_that_resolves_to_nccl_is_refused_and_one_on_gloo_is_not(eight_gpus, monkeypatch):
    cfg = TrainConfig(strategy="zero2", nproc=2, steps=1, model=SMALL, collectives="refimpl")
    with pytest.raises(LayoutError, match=REASON):
        validate(cfg)
    validate(cfg.with_(device="cpu"))               # --device cpu: gloo, as today
    validate(cfg.with_(collectives="torch"))        # torch's collectives on NCCL
    monkeypatch.setenv("REFIMPL_SHARED_DEVICE", "cuda:0")   # the staged harness stages over gloo
    validate(cfg)


def test_under_torchrun_the_nodes_backend_decides(eight_gpus, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(name, value)
    cfg = TrainConfig(strategy="dp", nproc=16, steps=1, global_batch=16, model=SMALL,
                      collectives="refimpl")
    with pytest.raises(LayoutError, match=REASON):
        validate(cfg)


def _async_on_nccl(rank: int, world_size: int) -> dict:
    """On a real gloo rank, a group that says it is NCCL's: the lane refuses it, a blocking call
    (on the caller's thread, no second thread) still runs."""
    import torch.distributed as dist

    import refimpl.comm as comm
    from refimpl.lab.runtime.lane import on_lane

    all_reduce = on_lane(comm.all_reduce)
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        try:
            all_reduce(torch.ones(4), async_op=True)
            refused = None
        except RuntimeError as e:
            refused = str(e)
        t = torch.ones(4)
        all_reduce(t)
    finally:
        dist.get_backend = real
    return {"refused": refused, "blocking": t.tolist()}


@pytest.mark.ranks
def test_refimpl_comms_lane_refuses_an_nccl_group():
    (got,) = launch.run(_async_on_nccl, 1, backend="gloo", timeout=120, quiet=True)
    assert got["refused"] is not None and "run on gloo only" in got["refused"], got
    assert got["blocking"] == [1.0] * 4
