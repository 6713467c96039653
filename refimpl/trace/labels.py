"""Labels: the names the code under test gives its phases and communication calls.

`phase("forward" | "backward" | "optimizer")` around each phase of a step, `comm_span(op, nbytes)`
around every collective (a `comm:<op> <n>B` range, the bytes in the name so the loader builds a
bandwidth table). Both are plain `record_function` ranges: free when no profiler is running. This
module is the bottom of the package's layers (the model's MoE layer labels its phases too); it
imports torch's profiler only when a label is made.
"""
from __future__ import annotations

import re

PHASES = ("forward", "backward", "optimizer")
COMM_LABEL = re.compile(r"^comm:(?P<op>[\w\-]+)(?: (?P<bytes>\d+)B)?$")


def phase(name: str):
    """Label a phase of a step (forward, backward, optimizer, or any compute you name)."""
    from torch.profiler import record_function

    return record_function(name)


def comm_span(op: str, nbytes: int | None = None):
    """Label one communication call; bytes in the name let the loader build a bandwidth table."""
    from torch.profiler import record_function

    return record_function(f"comm:{op}" + (f" {int(nbytes)}B" if nbytes is not None else ""))


def categorize(name: str) -> str:
    """forward / backward / optimizer / comm / step / op, from a range's name."""
    if name in PHASES:
        return name
    if COMM_LABEL.match(name) or name.startswith(("gloo:", "nccl:", "c10d::", "record_param_comms")):
        return "comm"
    if name.startswith("ProfilerStep#"):
        return "step"
    return "op"
