"""The twins' `--strategy` names, for refimpl.registry: a plug-in of the entry-point group
"refimpl.strategies" (pyproject.toml), so the core's registry never names them."""
from __future__ import annotations

from refimpl.lab.twins.torch_pp import TWIN_SCHEDULES
from refimpl.registry import Entry

TORCH_PP = "refimpl.lab.twins.torch_pp:TorchPipelineParallel"


def strategies() -> dict[str, Entry]:
    """torch-*: each twin's class; torch-tp and torch-pp-<schedule> are shorthands (the whole
    world on their axis)."""
    return {
        "torch-ddp": Entry("refimpl.lab.twins.torch_ddp:TorchDDP"),
        "torch-zero1": Entry("refimpl.lab.twins.torch_zero1:TorchZero1"),
        "torch-fsdp2": Entry("refimpl.lab.twins.torch_fsdp2:TorchFSDP2"),
        "torch-fsdp2-gradop": Entry("refimpl.lab.twins.torch_fsdp2:TorchFSDP2GradOp"),
        "torch-tp": Entry("refimpl.lab.twins.torch_tp:TorchTensorParallel", axis="tp"),
        "torch-fsdp2-tp": Entry("refimpl.lab.twins.torch_fsdp2_tp:TorchFSDP2TP"),
        **{f"torch-pp-{s}": Entry(TORCH_PP, axis="pp", schedule=s) for s in TWIN_SCHEDULES},
    }
