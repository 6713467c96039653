"""One launch per world size runs every tensor-parallel check (refimpl.lab.verify.tp_checks); cached
for the session so each test reads the same results."""
from __future__ import annotations

import functools

from refimpl import launch
from refimpl.lab.verify.tp_checks import BLOCK_CFG, B, S, all_checks  # noqa: F401 (re-exported)


@functools.cache
def checks_on(world: int, vocab: int = 512) -> list[dict]:
    return launch.run(all_checks, world, vocab, timeout=300)
