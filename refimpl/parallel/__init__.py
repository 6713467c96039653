"""One strategy per file. `get_strategy(name)` imports the one asked for.

The registry maps a `--strategy` name to "module:Class". From-scratch strategies and PyTorch's
built-in twins (prefixed `torch-`) run through the same loop, so any comparison is one command.
"""
from __future__ import annotations

import importlib

from refimpl.strategy import LayoutError, Strategy

STRATEGIES: dict[str, str] = {
    "single": "refimpl.parallel.single:Single",
}


def get_strategy(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise LayoutError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)
