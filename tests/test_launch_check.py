"""One run of `make launch-check` inside `make test` (scripts/launch_check.py): the CLI under
torchrun with the c10d rendezvous on localhost, 2 agents x 2 ranks as two nodes would, with
--profile; both agents exit 0 and rank 0 prints single's losses. The 20-run repetitions with and
without --profile, and the kill -9 restart, are `make launch-check`'s (minutes, not seconds).
It replaces test_cli's one-rank torchrun run: the same entry, on 4 ranks and two agents.
Marked `full` (make test-full): 14 s of make test's 10 minutes, for a path that `make launch-check`
runs twenty times and tests/test_launch.py's torchrun test enters with the same launcher."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import launch_check  # noqa: E402

pytestmark = [pytest.mark.ranks, pytest.mark.full]


def test_cli_under_c10d_torchrun_exits_zero_with_singles_losses(tmp_path):
    assert launch_check.exits(1, profile=True, work=tmp_path) == []
