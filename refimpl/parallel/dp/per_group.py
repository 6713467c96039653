"""One mechanism per data-parallel group (dp x cp; a MoE's experts over edp): how dp, ZeRO and FSDP
run a MoE model with --ep."""
from __future__ import annotations

import contextlib

from refimpl.placement import data_parallel_axis


class PerGroup:
    """`parts`: one mechanism per data-parallel axis of the trainable parameters, in order."""

    def __init__(self, named, build):
        by_axis: dict[str, list] = {}
        for name, p in named:
            if p.requires_grad:
                by_axis.setdefault(data_parallel_axis(p), []).append((name, p))
        self.parts = [build(axis, part) for axis, part in by_axis.items()]

    def __iter__(self):
        return iter(self.parts)

    @contextlib.contextmanager
    def micro_step(self, is_last: bool):
        """Each part's context around one micro-batch's forward and backward."""
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.micro_step(is_last))
            yield

    def finish_gradient_synchronization(self) -> None:
        """Each part's gradients summed over its own group, dense first (every rank alike)."""
        for part in self.parts:
            part.finish_gradient_synchronization()
