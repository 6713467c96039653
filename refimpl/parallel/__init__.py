"""One strategy per file. `get_strategy(name)` imports the one asked for.

The registry maps a `--strategy` name to "module:Class". From-scratch strategies and PyTorch's
built-in twins (prefixed `torch-`) run through the same loop, so any comparison is one command.
"""
from __future__ import annotations

import importlib

from refimpl.mesh import LayoutError
from refimpl.strategy import Strategy

STRATEGIES: dict[str, str] = {
    "single": "refimpl.parallel.dp.single:Single",
    "dp-naive": "refimpl.parallel.dp.naive:NaiveDataParallel",
    "dp": "refimpl.parallel.dp.bucketed:BucketedDataParallel",
    "torch-ddp": "refimpl.parallel.dp.torch_ddp:TorchDDP",
    "zero1": "refimpl.parallel.zero.stages:Zero1",
    "zero2": "refimpl.parallel.zero.stages:Zero2",
    "torch-zero1": "refimpl.parallel.zero.torch_zero1:TorchZero1",
    "zero3": "refimpl.parallel.fsdp.zero3:Zero3",
    "fsdp": "refimpl.parallel.fsdp.fully_shard:FSDP",
    "torch-fsdp2": "refimpl.parallel.fsdp.torch_fsdp2:TorchFSDP2",
    "torch-fsdp2-gradop": "refimpl.parallel.fsdp.torch_fsdp2:TorchFSDP2GradOp",
    "tp": "refimpl.parallel.tp.strategy:TensorParallel",
    "torch-tp": "refimpl.parallel.tp.torch_tp:TorchTensorParallel",
    "torch-fsdp2-tp": "refimpl.compose.torch_fsdp2_tp:TorchFSDP2TP",
    "pp-gpipe": "refimpl.parallel.pp.strategy:PipelineParallel",
    "pp-1f1b": "refimpl.parallel.pp.strategy:PipelineParallel",
    "pp-interleaved": "refimpl.parallel.pp.strategy:PipelineParallel",
    "pp-zb": "refimpl.parallel.pp.strategy:PipelineParallel",
    "pp-interleaved-zb": "refimpl.parallel.pp.strategy:PipelineParallel",
    "pp-zbv": "refimpl.parallel.pp.strategy:PipelineParallel",
    "pp-dualpipev": "refimpl.parallel.pp.strategy:PipelineParallel",
    "torch-pp-gpipe": "refimpl.parallel.pp.strategy:TorchPipelineParallel",
    "torch-pp-1f1b": "refimpl.parallel.pp.strategy:TorchPipelineParallel",
    "torch-pp-interleaved": "refimpl.parallel.pp.strategy:TorchPipelineParallel",
    "torch-pp-interleaved-zb": "refimpl.parallel.pp.strategy:TorchPipelineParallel",
    "torch-pp-zbv": "refimpl.parallel.pp.strategy:TorchPipelineParallel",
    "torch-pp-dualpipev": "refimpl.parallel.pp.strategy:TorchPipelineParallel",
    "ep": "refimpl.parallel.ep.strategy:ExpertParallel",
}


def get_strategy(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise LayoutError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)
